"""A Hugging Face folder written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes
it, for the families whose random-weight models the benchmarks build: so llama.cpp can run the
same weights as kvedge (`bench/hybrid.py`), an export from a GGUF is measured at a real size
(`bench/scale.py --gguf`), and the tests can check `kvedge.export.gguf_blocks` against files like
the converter's without it (it is no package). The folder is read a tensor at a time
(`kvedge.export.streamed`), so a model at a real size is written in bounded memory.

Llama, Qwen2 and Qwen3 (its LlamaModel and Qwen2/Qwen3Model): names, Q and K rows of "llama"
permuted for its interleaved RoPE, the hyperparameters transformers reads back; Llama 3's RoPE
scaling (the converter's rope_freqs table) is not written, which changes the RoPE and not a byte
of the weights (the scale benchmark measures memory and time, not answers).

What the converter (its LFM2Model and Qwen3_5TextModel) does and this repeats: names from gguf's
own TensorNameMap; depthwise convolution kernels [C, 1, k] squeezed to [C, k]; for Qwen3.5, norms
written as 1 + w (but the Gated DeltaNet's own), A_log as -exp(A_log), dt_bias as ssm_dt.bias,
and the value heads of each Gated DeltaNet tensor reordered from grouped (by key head) to tiled;
every matrix whose rows are whole blocks in `kind` (--outtype q8_0), the rest float32; the
tokenizer as a BPE one ("gpt2", the "default" pre-tokenizer). Checked against the converter of
llama-cpp-python 0.3.36's vendored llama.cpp on tiny models of both families: the same tensors
and metadata, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCHITECTURES = {  # model_type -> general.architecture
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "lfm2": "lfm2",
    "qwen3_5_text": "qwen35",
}
KERNELS = ("shortconv.conv.weight", "ssm_conv1d.weight")  # kept float32, as the converter does


def add_gguf_tokenizer(writer: Any, folder: Path, vocab_size: int, chat_template: str | None) -> None:
    """The BPE tokenizer of `folder` (tokenizer.json) as llama.cpp's converter writes one (gpt2,
    default pre-tokenizer), its vocabulary padded to the model's `vocab_size`; its BOS / EOS ids
    from config.json, else tokenizer_config.json's tokens; `chat_template`, else the folder's."""
    from gguf import TokenType

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokens = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    special = {added["content"] for added in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    merges = tokenizer["model"]["merges"]  # ["a", "b"] pairs, or "a b" in older tokenizers
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    ids = tokenizer["model"]["vocab"]
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    named = _json(folder / "tokenizer_config.json")  # where the config names none: "eos_token"
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        token = config.get(key)
        if not isinstance(token, int):
            text = named.get(key.removesuffix("_id"))
            token = ids.get(text["content"] if isinstance(text, dict) else text)
        if isinstance(token, int) and token < len(ids):
            add(token)
    template = folder / "chat_template.jinja"  # the converter writes the folder's own
    chat_template = chat_template or (
        template.read_text() if template.is_file() else named.get("chat_template")
    )
    if chat_template:
        writer.add_chat_template(chat_template)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def write_gguf(folder: Path, path: Path, kind: str | None = None, chat_template: str | None = None) -> Path:
    """The model in `folder` (a family of `GGUF_ARCHITECTURES`) written as the GGUF file `path`
    (module docstring); `kind` ("Q8_0"): the type of its matrices, None for float32. Returns
    `path`."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from kvedge.export.source import load_hf, opened, resolve_source, stream_source

    source = resolve_source(folder)
    read = stream_source(source) or opened(*load_hf(source))
    config, state = read.model.config, read.weights
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(folder.name)
    _add_hyperparameters(writer, config, state)
    add_gguf_tokenizer(writer, folder, config.vocab_size, chat_template)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    for name in list(state):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = np.asarray(state[name], np.float32)
        if config.model_type == "qwen3_5_text":
            w = _qwen35_layout(name, w, config)
            name = name.replace(".dt_bias", ".dt_proj.bias")
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel.permute
            n = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if name.endswith(("conv.conv.weight", "conv1d.weight")):
            w = w.squeeze(1)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if w.ndim == 2 and kind is not None and w.shape[1] % 32 == 0 and not gguf_name.endswith(KERNELS):
            raw = GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(w), raw), raw_dtype=raw)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hyperparameters(writer: Any, config: Any, state: dict[str, np.ndarray]) -> None:
    """The `<arch>.*` keys the converter writes for `config`."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if config.model_type in ("llama", "qwen2", "qwen3"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        if config.model_type == "llama":
            writer.add_rope_dimension_count(head_dim)
        else:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        return
    if config.model_type == "lfm2":
        writer.add_feed_forward_length(state["model.layers.0.feed_forward.w1.weight"].shape[0])
        kv_heads = [0 if t == "conv" else config.num_key_value_heads for t in config.layer_types]
        writer.add_head_count_kv(kv_heads)  # 0: a convolution layer
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_vocab_size(config.vocab_size)
        writer.add_shortconv_l_cache(config.conv_L_cache)
        return
    head_dim = config.head_dim
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    recurrent = [t == "linear_attention" for t in config.layer_types]
    writer.add_array("qwen35.attention.recurrent_layers", recurrent)  # gguf 0.19 has no add_ for it
    writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections([*config.rope_parameters.get("mrope_section", [11, 11, 10]), 0])


def _qwen35_layout(name: str, w: np.ndarray, config: Any) -> np.ndarray:
    """Qwen3.5's tensor `name` as the converter writes it: norms as 1 + w (but the Gated
    DeltaNet's), A_log as -exp(A_log), the value heads of Gated DeltaNet tensors tiled."""
    import torch

    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim

    def tiled(w: np.ndarray, dim: int, axis: int = 0) -> np.ndarray:  # grouped [nk, nv/nk, d] -> tiled
        w = np.moveaxis(w, axis, 0)
        shape = w.shape
        w = w.reshape(nk, nv // nk, dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.ascontiguousarray(np.moveaxis(w, 0, axis))

    if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
        return w + np.float32(1.0)
    if name.endswith(".A_log"):
        w = -torch.exp(torch.from_numpy(w)).numpy()  # as the converter computes it
    if name.endswith((".A_log", ".dt_bias", "in_proj_a.weight", "in_proj_b.weight")):
        return tiled(w, 1)
    if name.endswith("in_proj_z.weight"):
        return tiled(w, dv)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        qk = 2 * nk * dk
        return np.concatenate([w[:qk], tiled(w[qk:], dv)])
    if name.endswith("linear_attn.out_proj.weight"):
        return tiled(w, dv, axis=1)
    return w
