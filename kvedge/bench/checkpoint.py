"""A random-weight Hugging Face checkpoint at a model card's real shape (configs/models), written
tensor by tensor: the export's scale is measured without a model hub, and making the checkpoint
holds one tensor at a time, not the model.

The config is the card's architecture in transformers' names (`hf_config`); the tensors are the
names and shapes of transformers' own model of that config (its skeleton on the meta device), so
the parameter count is checked against the card's `param_count`. Values: matrices normal with
the config's initializer_range, vectors (norms, biases, a recurrent layer's constants) 1.0, all
stored as bfloat16, the published checkpoints' type. Random weights measure memory, time and
bytes, never answers. The tokenizer is SmolLM2's (the ids are random too).
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from tqdm import tqdm

from kvedge.configs import load_recipe
from kvedge.errors import KvedgeError

log = logging.getLogger(__name__)

# the card's architecture fields -> transformers' config names, where they differ
RENAMED = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
# per family (the card's), fields whose transformers name differs again
FAMILY_RENAMED = {
    "lfm2": {"conv_kernel": "conv_L_cache", "intermediate_size": "block_ff_dim"},
    "qwen3_5_text": {"conv_kernel": "linear_conv_kernel_dim"},
}
# values the card leaves to the family's published config
FAMILY_FIXED: dict[str, dict[str, Any]] = {
    "lfm2": {"block_auto_adjust_ff_dim": False, "block_multiple_of": 1},
}
# the card's bookkeeping, not a config field
NOT_CONFIG = {"family", "param_count"}


def hf_config(card_name: str, layers: int | None = None) -> tuple[Any, int]:
    """(transformers config of configs/models/`card_name`, the card's param_count), the first
    `layers` layers only when given (the layer pattern kept)."""
    from transformers import AutoConfig

    architecture = load_recipe(card_name).architecture
    fields = {
        k: v for k, v in msgspec.structs.asdict(architecture).items() if v is not None and k not in NOT_CONFIG
    }
    family = architecture.family
    names = {**RENAMED, **FAMILY_RENAMED.get(family, {})}
    data = {names.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
    data.update(FAMILY_FIXED.get(family, {}))
    if family == "gemma4_text":  # HF names each layer's kind; the card gives Gemma 3's pattern
        local = architecture.local_layers
        data["layer_types"] = [
            "sliding_attention" if i in local else "full_attention" for i in range(architecture.num_layers)
        ]
        del data["sliding_window_pattern"]
    if layers:
        data["num_hidden_layers"] = layers
        if "layer_types" in data:
            data["layer_types"] = data["layer_types"][:layers]
        if data.get("num_kv_shared_layers"):  # the shared layers are the last: none of the first
            data["num_kv_shared_layers"] = max(0, layers - len(architecture.kv_layers))
    return AutoConfig.for_model(family, **data), architecture.param_count


def write_checkpoint(card_name: str, folder: Path, layers: int | None = None, seed: int = 0) -> int:
    """A random bfloat16 checkpoint of the card (config.json, model.safetensors, SmolLM2's
    tokenizer) in `folder`; returns its parameter count, the card's at full depth."""
    from transformers import AutoTokenizer

    from kvedge.export.source import default_gguf
    from kvedge.export.streamed import skeleton

    config, card_count = hf_config(card_name, layers)
    model = skeleton(config)
    ties = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in ties}
    buffers = {n for n, _ in model.named_buffers()}
    shapes = {n: s for n, s in shapes.items() if n not in buffers}
    count = sum(int(np.prod(s)) for s in shapes.values())
    if not layers and count != card_count:
        raise KvedgeError(
            f"configs/models/{card_name}: transformers builds {count:,} parameters from its "
            f"architecture, the card says {card_count:,}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    _write_safetensors(folder / "model.safetensors", shapes, float(config.initializer_range), seed)
    config.architectures = [type(model).__name__]  # as a published config.json names it
    config.save_pretrained(folder)
    gguf = default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    log.info("wrote %s: %s parameters of %s", folder, f"{count:,}", card_name)
    return count


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], std: float, seed: int) -> None:
    """`shapes`' tensors as bfloat16 in one safetensors file, each made and written in turn."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with (
        path.open("wb") as handle,
        tqdm(total=offset, desc="random checkpoint", unit="B", unit_scale=True) as bar,
    ):
        handle.write(struct.pack("<Q", len(raw)) + raw)
        for shape in shapes.values():
            for values in _values(rng, shape, std):
                handle.write(values.tobytes())
                bar.update(values.nbytes)


def _values(rng: np.random.Generator, shape: tuple[int, ...], std: float):
    """The tensor's bfloat16 bits (uint16), row chunks of about 16M values at a time."""
    if len(shape) == 1:
        yield np.full(shape, 0x3F80, np.uint16)  # 1.0
        return
    rows = shape[0]
    per_row = int(np.prod(shape[1:]))
    step = max(1, (1 << 24) // per_row)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        values = rng.standard_normal(n * per_row, dtype=np.float32) * np.float32(std)
        yield (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
