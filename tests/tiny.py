"""Tiny random-weight Hugging Face models with a real tokenizer, built in code (no download), and
some written as GGUF files with quantized tensors (`make_tiny_gguf`, `make_tiny_hybrid_gguf`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Gemma4TextConfig,
    Lfm2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    SmolLM3Config,
)

from kvedge.bench.gguf_file import add_gguf_tokenizer, write_gguf

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3's switch as its own template has it: with enable_thinking=false the generation prompt
# carries an empty think block, so the model answers directly.
QWEN3_CHATML = CHATML.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}",
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Gemma 3's template as it treats roles: no system role (the system message is folded into the
# first user turn), "model" for the assistant, alternation enforced with raise_exception.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TEMPLATES = {
    "qwen3": QWEN3_CHATML,
    "phi3": PHI3_TEMPLATE,
    "gemma3": GEMMA3_TEMPLATE,
    "gemma4": GEMMA3_TEMPLATE,
}
SPECIAL_TOKENS = {
    "gemma3": ("<start_of_turn>", "<end_of_turn>"),
    "gemma4": ("<start_of_turn>", "<end_of_turn>"),
}
# Gemma 3's shape in small: local (sliding-window) layers around a global one, head_dim apart
# from hidden / heads, a query scale apart from head_dim**-0.5, window 8 (ring 8 + 64 slots)
GEMMA3 = {
    "head_dim": 32,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "pad_token_id": 0,
}
# Gemma 4's shape in small: sliding layers (head_dim 16, window 8) and global ones (head_dim 32,
# a quarter rotated: "proportional" RoPE), the last three layers reading the KV of layers 1 and 3
# (num_kv_shared_layers; twice as wide an MLP there), per-layer inputs of 16 per layer, softcapped
# logits (E2B: 35 layers, 20 shared, head_dim 256 / 512, per-layer 256)
GEMMA4_LAYERS = [
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
GEMMA4 = {
    "head_dim": 16,
    "global_head_dim": 32,
    "layer_types": GEMMA4_LAYERS,
    "num_hidden_layers": len(GEMMA4_LAYERS),
    "num_kv_shared_layers": 3,
    "sliding_window": 8,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 320,
    "final_logit_softcapping": 30.0,
    "use_double_wide_mlp": True,
    "pad_token_id": 0,
}
# LFM2's shape in small: convolution layers first and last, attention between (LFM2-1.2B: 10 conv,
# 6 attention layers)
LFM2_LAYERS = ["conv", "full_attention", "conv", "conv", "full_attention"]
# Qwen3.5's shape in small: three Gated DeltaNet layers to one gated attention layer (head_dim 32,
# a quarter of it rotated), two key heads serving four value heads, a kernel of 4
QWEN35 = {
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "pad_token_id": 0,
}
# Phi-4-mini's RoPE shape: 3/4 of each head rotated, LongRoPE factors (short ones apply below
# original_max_position_embeddings, which the tests' exports stay under).
PHI3_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.5],  # head_dim 16 x 0.75 / 2 pairs
    "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    "original_max_position_embeddings": 256,
}
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache stores keys and values of past tokens so decoding does not recompute them.",
    "Jetson Orin boards share memory between the CPU and the GPU.",
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris.",
] * 20


def tiny_tokenizer(
    chat_template: str = CHATML, extra_special: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "<|im_end|>", "<|im_start|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<s>", unk_token="<unk>"
    )
    fast.chat_template = chat_template
    return fast


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": overrides.get("tie_word_embeddings", False)})
    if family == "mistral":
        return MistralConfig(**{**common, "sliding_window": None})
    if family == "qwen3":  # head_dim 32, not hidden / heads = 16: Q and K widths differ from hidden
        return Qwen3Config(**{"head_dim": 32, **common})
    if family == "phi3":  # max_position / original = 8 gives LongRoPE an attention factor of ~1.17
        longer = overrides.get("max_position_embeddings", 2048)
        return Phi3Config(
            **{
                "rope_parameters": dict(PHI3_ROPE),  # the config edits the dict it is given
                "pad_token_id": 0,
                **common,
                "max_position_embeddings": longer,
                "original_max_position_embeddings": PHI3_ROPE["original_max_position_embeddings"],
            }
        )
    if family == "gemma3":
        return Gemma3TextConfig(**{**common, **GEMMA3, **overrides})
    if family == "gemma4":
        layers = overrides.get("layer_types", GEMMA4_LAYERS)
        return Gemma4TextConfig(**{**common, **GEMMA4, "num_hidden_layers": len(layers), **overrides})
    if family == "lfm2":  # conv layers around attention ones (LFM2_LAYERS), Q/K norms per head
        lfm2 = {
            "layer_types": LFM2_LAYERS,
            "conv_L_cache": 3,
            "norm_eps": 1e-5,
            "block_auto_adjust_ff_dim": False,
        }
        common.pop("rms_norm_eps")
        layers = overrides.get("layer_types", LFM2_LAYERS)
        return Lfm2Config(**{**common, **lfm2, "num_hidden_layers": len(layers), **overrides})
    if family == "qwen3_5":  # Gated DeltaNet layers around a gated attention one (QWEN35)
        layers = overrides.get("layer_types", QWEN35["layer_types"])
        return Qwen3_5TextConfig(**{**common, **QWEN35, "num_hidden_layers": len(layers), **overrides})
    if family == "smollm3":  # no RoPE in layer 0, the one eviction tests compare (SmolLM3-3B: every 4th)
        return SmolLM3Config(**{"no_rope_layers": [0, 1], "pad_token_id": 0, **common})
    raise ValueError(family)


def make_tiny_model(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `family` plus tokenizer into `folder`; return it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():  # random init is small; widen it so logits are far from uniform
        for p in model.parameters():
            # Gemma 4 at 4x: its unscaled scores put transformers' own float32 logits 1.4e-4 from float64
            p.mul_(2.0 if family == "gemma4" else 4.0) if p.dim() > 1 else None
            if family == "gemma3" and p.dim() == 1:  # its norms start at w = 0: make (1 + w) matter
                p.add_(0.5 * torch.randn_like(p))
            if family in ("gemma4", "lfm2", "qwen3_5") and p.dim() == 1:  # norms at 1 (0 in 1 + w), ...
                p.add_(0.2 * torch.randn_like(p))  # as a checkpoint's: a channel order shows
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # 1 at init; a checkpoint's scale each layer
                buffer.copy_(0.5 + torch.rand_like(buffer))
    model.save_pretrained(folder)
    tiny_tokenizer(TEMPLATES.get(family, CHATML), SPECIAL_TOKENS.get(family, ())).save_pretrained(folder)
    return folder


# GGUF's names of the Llama layer tensors tiny models have (llama.cpp's convert_hf_to_gguf.py)
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def make_tiny_gguf(
    path: Path,
    kinds: dict[str, str],
    seed: int = 0,
    quantizer: Callable[[np.ndarray, GGMLQuantizationType], np.ndarray] = quantize,
) -> Path:
    """A tiny random Llama (`make_tiny_model`'s, tied embeddings) written as the GGUF file `path`,
    as llama.cpp's converter writes one: its metadata and tokenizer, Q and K rows permuted for
    interleaved RoPE, each matrix quantized by `quantizer` (gguf's own by default: w [N, K],
    type -> raw blocks) to `kinds`' type for its GGUF name ("attn_q": "Q4_0", "token_embd":
    "Q8_0"; float32 for the rest). Returns `path`."""
    folder = make_tiny_model(path.parent / f"{path.stem}-hf", "llama", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    config, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    add_gguf_tokenizer(writer, folder, config.vocab_size, CHATML)

    def add(name: str, w: np.ndarray) -> None:
        kind = kinds.get(name.split(".")[-1])
        if kind is None:
            writer.add_tensor(f"{name}.weight", w)
        else:
            raw = GGMLQuantizationType[kind]
            writer.add_tensor(f"{name}.weight", quantizer(w, raw), raw_dtype=raw)

    add("token_embd", state["model.embed_tokens.weight"])
    add("output_norm", state["model.norm.weight"])
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):
        for hf, name in GGUF_LAYER_NAMES.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if name in heads:  # llama.cpp's LlamaModel.permute
                n = heads[name]
                w = w.reshape(n, 2, w.shape[0] // n // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
            add(f"blk.{i}.{name}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_tiny_hybrid_gguf(
    path: Path, family: str, kind: str | None = None, seed: int = 0, **overrides
) -> Path:
    """A tiny random `family` model ("lfm2", "qwen3_5") written as the GGUF file `path` the way
    llama.cpp's converter writes it (`kvedge.bench.gguf_file.write_gguf`, `kind` its
    matrices' type or None for float32); the Hugging Face folder beside it (`<stem>-hf`) holds the
    same weights (`make_tiny_model`'s, every 1-D one off its initial value, so the file's
    transforms show)."""
    folder = make_tiny_model(path.parent / f"{path.stem}-hf", family, seed=seed, **overrides)
    return write_gguf(folder, path, kind, chat_template=CHATML)


# AWQ / GPTQ checkpoints (`make_tiny_packed`): a Llama wide enough for groups of 128 (K 128 and
# 256), head_dim 16 (the softmax scale 1/4 folded into Wq stays exact on the blocks)
PACKED_LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4)
PACKED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map (WQLinear_GEMM.from_linear)
EMBEDDING_STEP = 2.0**-10  # the embedding's codes step: an 8-bit grid the export's head keeps exactly


def packed_grid(w: np.ndarray, group: int, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A known 4-bit grid for w [N, K]: (u [N, K], z [N, K/g], s [N, K/g] float16), w ~ s (u - z).
    sym: z = 8 on absmax / 7 (GPTQ sym); else min / max, with a few zeros forced to 0 and 15 (the
    ends, where GPTQ v1's stored z - 1 borrows from the next field)."""
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    if sym:
        s = (np.abs(blocks).max(axis=2) / 7).astype(np.float16)
        z = np.full(s.shape, 8, np.int64)
    else:
        low, high = blocks.min(axis=2), blocks.max(axis=2)
        s = ((high - low) / 15).astype(np.float16)
        z = np.clip(np.rint(-low / s.astype(np.float32)), 0, 15).astype(np.int64)
        z[:8, 0], z[8:16, 0], z[16, :] = 0, 15, 0
    u = np.rint(blocks / s.astype(np.float32)[..., None]) + z[..., None]
    return np.clip(u, 0, 15).astype(np.int64).reshape(n, k), z, s


def pack_awq(u: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qweight [K, N/8], qzeros [K/g, N/8]) int32 from u [N, K] and z [N, K/g], as AutoAWQ's
    WQLinear_GEMM.from_linear packs them (awq/modules/linear/gemm.py)."""
    intweight, zeros = u.T.astype(np.uint32), z.T.astype(np.uint32)  # [K, N], [K/g, N]
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), np.uint32)
    for col in range(zeros.shape[1] // 8):
        for i in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return qweight.view(np.int32), qzeros.view(np.int32)


def pack_gptq(u: np.ndarray, z: np.ndarray, v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """(qweight [K/8, N], qzeros [K/g, N/8]) int32 from u [N, K] and z [N, K/g], as AutoGPTQ's
    QuantLinear.pack packs them (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py); v1: each
    qzeros word less 0x11111111, as gptqmodel's convert_gptq_v2_to_v1_format (gptqmodel/utils/model.py)."""
    intweight, zeros = u.T.astype(np.uint32), z.T.astype(np.uint32)  # [K, N], [K/g, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    if v1:
        qzeros = qzeros - np.uint32(0x11111111)  # wraps modulo 2**32, borrows carried
    return qweight.view(np.int32), qzeros.view(np.int32)


def make_tiny_packed(
    folder: Path, quantization: dict, seed: int = 0, sym: bool = False
) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny random Llama (`PACKED_LLAMA`, tied embeddings) saved as an AWQ or GPTQ checkpoint
    (`quantization`: config.json's quantization_config; its quant_method, group_size and, for
    GPTQ, checkpoint_format decide the packing) in `folder`, every projection on `packed_grid`
    (GPTQ: `sym`), the other tensors float16 (the embedding on an 8-bit grid of step
    `EMBEDDING_STEP`); beside it `folder`-float, the same model's float32 weights (the projections
    dequantized: s (u - z)), which transformers loads as it is. Returns (folder, {HF name: the
    dequantized projection [N, K] float32})."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **PACKED_LLAMA))
    group, method = quantization["group_size"], quantization["quant_method"]
    state = {k: v.numpy().astype(np.float16).astype(np.float32) for k, v in model.state_dict().items()}
    codes = rng.integers(-127, 128, state["model.embed_tokens.weight"].shape)
    codes[:, ::32] = -128  # each block of 32 holds the extreme: the export's 8-bit grid is this one
    state["model.embed_tokens.weight"] = (codes * EMBEDDING_STEP).astype(np.float32)
    packed, dequantized = {}, {}
    for i in range(model.config.num_hidden_layers):
        for linear in PACKED_LINEARS:
            part = "self_attn" if linear.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"model.layers.{i}.{part}.{linear}"
            w = state.pop(f"{name}.weight") * 4.0  # wider than the random init, as make_tiny_model
            u, z, s = packed_grid(w, group, sym)
            dequantized[f"{name}.weight"] = (
                np.repeat(s.astype(np.float32), group, axis=1) * (u - np.repeat(z, group, axis=1))
            ).astype(np.float32)
            if method == "awq":
                qweight, qzeros = pack_awq(u, z)
            else:
                qweight, qzeros = pack_gptq(u, z, v1=quantization.get("checkpoint_format", "gptq") == "gptq")
                packed[f"{name}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // group
            packed[f"{name}.qweight"] = torch.from_numpy(qweight)
            packed[f"{name}.qzeros"] = torch.from_numpy(qzeros)
            packed[f"{name}.scales"] = torch.from_numpy(np.ascontiguousarray(s.T))  # [K/g, N] float16
    state.pop("lm_head.weight", None)  # tied
    floats = {k: torch.from_numpy(v).to(torch.float16) for k, v in state.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**floats, **packed}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    reference = folder.parent / f"{folder.name}-float"
    model.load_state_dict({k: torch.from_numpy(v) for k, v in {**state, **dequantized}.items()}, strict=False)
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    return folder, dequantized


def gemma4_supported() -> bool:
    """Whether this transformers runs Gemma 4 as kvedge follows it (5.25: `kv_sharing_modes`);
    the 3.10 CI venv's older pin does not."""
    from transformers import Gemma4TextConfig

    return hasattr(Gemma4TextConfig(), "kv_sharing_modes")


def card_architecture(config: Any, params: int, **fields: Any) -> Any:
    """A tied tiny transformers `config` as a configs/models card's `Architecture` (its
    `params`), with a family's own `fields` beside the common ones, or in their place (read only
    where not given: Gemma 4's config refuses a global head_dim)."""
    from kvedge.configs import Architecture

    common = dict(
        family=lambda: config.model_type,
        num_layers=lambda: config.num_hidden_layers,
        num_heads=lambda: config.num_attention_heads,
        num_kv_heads=lambda: config.num_key_value_heads,
        head_dim=lambda: (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        ),
        hidden_size=lambda: config.hidden_size,
        intermediate_size=lambda: config.intermediate_size,
        vocab_size=lambda: config.vocab_size,
        tie_word_embeddings=lambda: True,
        attention_bias=lambda: False,
        max_position_embeddings=lambda: config.max_position_embeddings,
        param_count=lambda: params,
    )
    return Architecture(**{key: read() for key, read in common.items() if key not in fields}, **fields)
