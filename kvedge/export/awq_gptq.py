"""An AWQ or GPTQ checkpoint's int4 weights as kvedge's own blocks (`quantize.QuantizedWeight`),
kept as they are: no dequantize-then-requantize, so the export adds no rounding of its own.

Both formats store a Linear's weight [N, K] (N outputs, K inputs) as unsigned 4-bit codes u, and
per group of g input channels and per output a float16 scale s and a 4-bit zero point z:
w = s (u - z). kvedge's block form [K, N] with block size g (as `gguf_blocks`, codes centred)::

    q = u - 8,  scale = s,  offset = s (8 - z)    (offset None where every z is 8: GPTQ sym)

q s and s (8 - z) are an 11-bit float16 times an integer of at most 5 bits, exact in float32, and so
is their sum s (u - z): every block dequantizes to the checkpoint's values bit for bit, and
`max_error` is 0.

File format: safetensors, int32 words of eight 4-bit fields, the lowest first; per Linear `name`:

    AWQ, version "gemm" (AutoAWQ's `WQLinear_GEMM.from_linear`, awq/modules/linear/gemm.py):
      name.qweight  int32 [K, N/8]    word (k, c), field i: u[k, 8c + AWQ_ORDER[i]]
      name.qzeros   int32 [K/g, N/8]  word (j, c), field i: z[j, 8c + AWQ_ORDER[i]]
      name.scales   float16 [K/g, N]
    GPTQ (AutoGPTQ's `QuantLinear.pack`, auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py):
      name.qweight  int32 [K/8, N]    word (r, n), field i: u[8r + i, n]
      name.qzeros   int32 [K/g, N/8]  word (j, c), field i: z[j, 8c + i], less 0x11111111 per
                    word in checkpoint_format "gptq" (v1: z - 1 per field, borrows carried, as
                    gptqmodel's `convert_gptq_v2_to_v1_format` writes it, gptqmodel/utils/model.py;
                    added back here), as it is in "gptq_v2"
      name.scales   float16 [K/g, N]
      name.g_idx    int32 [K]         each input channel's group: k // g (desc_act false)

Every other tensor (embeddings, norms, lm_head, biases) is a float tensor, read as float32 in its
Hugging Face shape. config.json's quantization_config names the format; refused, in one line
naming the value and what is read: bits other than 4, group sizes outside `BLOCK_SIZES`, AWQ
versions other than "gemm" (gemv, gemv_fast, marlin, exllama pack their words otherwise), GPTQ's
desc_act or a g_idx that is not k // g (input channels permuted), and checkpoint formats other
than gptq / gptq_v2 (marlin, bitblas, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.contract import BLOCK_SIZES
from kvedge.errors import KvedgeError
from kvedge.export.quantize import QuantizedWeight

METHODS = {"awq": "AWQ", "gptq": "GPTQ"}  # quant_method -> the name kvedge gives its blocks
AWQ_VERSIONS = ("gemm",)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of an AWQ word holds column AWQ_ORDER[i] of its 8
V1_ZEROS = np.uint32(0x11111111)  # one in every field: GPTQ v1 stores z - 1
BITS = 4


@dataclass(frozen=True)
class PackedFormat:
    """What config.json's quantization_config says of the packed weights."""

    method: str  # "AWQ" or "GPTQ"
    group_size: int  # input channels per scale and zero
    zeros_less_one: bool  # GPTQ v1: each qzeros word is stored less V1_ZEROS


@dataclass(frozen=True)
class PackedWeights:
    """An AWQ or GPTQ checkpoint's tensors under their Hugging Face names."""

    format: PackedFormat
    tensors: dict[str, QuantizedWeight | np.ndarray]  # QuantizedWeight [K, N]; float32 in HF shape
    types: dict[str, str]  # each quantized matrix's name -> its format, "AWQ" or "GPTQ"

    def float_state(self) -> dict[str, np.ndarray]:
        """The state dict transformers' float model takes: every weight float32 in its HF shape,
        the quantized ones dequantized ([N, K])."""
        return {
            name: np.ascontiguousarray(w.dequantize().T) if isinstance(w, QuantizedWeight) else w
            for name, w in self.tensors.items()
        }


def quantization_config(folder: Path) -> dict[str, Any] | None:
    """config.json's quantization_config in `folder`, or None for a float checkpoint."""
    found = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config")
    return found or None


def packed_format(config: dict[str, Any], where: str) -> PackedFormat:
    """The packed format a quantization_config describes, or a one-line refusal naming the value
    and what kvedge reads (the module docstring)."""
    method = str(config.get("quant_method", "")).lower()
    reads = (
        "kvedge reads AWQ (version gemm) and GPTQ (desc_act false, checkpoint_format gptq or "
        f"gptq_v2), {BITS}-bit, group size {' / '.join(map(str, BLOCK_SIZES))}"
    )

    def refuse(what: str) -> KvedgeError:
        return KvedgeError(f"{where}: {what}; {reads}")

    if method not in METHODS:
        raise refuse(f"quant_method {method!r} is not one kvedge reads")
    bits = config.get("bits", config.get("w_bit"))  # transformers' names, else AutoAWQ's own
    group = config.get("group_size", config.get("q_group_size"))
    if bits != BITS:
        raise refuse(f"{METHODS[method]} bits {bits!r}")
    if group not in BLOCK_SIZES:
        raise refuse(f"{METHODS[method]} group_size {group!r}")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            raise refuse(f"AWQ version {version!r} (its words are packed for another kernel)")
        return PackedFormat("AWQ", group, False)
    if config.get("desc_act"):
        raise refuse("GPTQ desc_act true (g_idx permutes the input channels)")
    form = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if config.get("is_marlin_format"):
        form = "marlin"
    if form not in GPTQ_FORMATS:
        raise refuse(f"GPTQ checkpoint_format {form!r} (its words are packed for another kernel)")
    return PackedFormat("GPTQ", group, form == "gptq")


def read_packed_weights(folder: str | Path) -> PackedWeights:
    """Every tensor of the AWQ or GPTQ checkpoint in `folder` (config.json + *.safetensors) under
    its Hugging Face name: each packed Linear as a QuantizedWeight [K, N], the rest float32."""
    folder = Path(folder)
    config = quantization_config(folder)
    if config is None:
        raise KvedgeError(f"{folder}: config.json has no quantization_config; not an AWQ or GPTQ checkpoint")
    form = packed_format(config, str(folder))
    raw = _read_safetensors(folder)
    tensors: dict[str, QuantizedWeight | np.ndarray] = {}
    types: dict[str, str] = {}
    for prefix in sorted(n.removesuffix(".qweight") for n in raw if n.endswith(".qweight")):
        parts = {part: raw.pop(f"{prefix}.{part}", None) for part in ("qweight", "qzeros", "scales", "g_idx")}
        tensors[f"{prefix}.weight"] = unpack(form, parts, f"{folder}: {prefix}")
        types[f"{prefix}.weight"] = form.method
    for name, value in raw.items():
        if not np.issubdtype(value.dtype, np.floating):
            raise KvedgeError(
                f"{folder}: tensor {name!r} is {value.dtype}, neither a float tensor nor a packed Linear's"
            )
        tensors[name] = value
    return PackedWeights(form, tensors, types)


def _read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """{name: array} over every *.safetensors file: float tensors (bfloat16 too) as float32."""
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                found[name] = (t.float() if t.is_floating_point() else t).numpy()
    if not found:
        raise KvedgeError(f"{folder}: no *.safetensors weights")
    return found


def unpack(form: PackedFormat, parts: dict[str, np.ndarray | None], where: str) -> QuantizedWeight:
    """One packed Linear (`parts`: qweight, qzeros, scales, and GPTQ's g_idx or None) as blocks
    [K, N] of `form.group_size` (the module docstring's table)."""
    missing = [part for part in ("qweight", "qzeros", "scales") if parts[part] is None]
    if missing:
        raise KvedgeError(f"{where}: {form.method} Linear has no {', '.join(missing)} tensor")
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    g = form.group_size
    groups, n = scales.shape  # [K/g, N]
    k = groups * g
    want = {"qweight": (k, n // 8) if form.method == "AWQ" else (k // 8, n), "qzeros": (groups, n // 8)}
    for part, shape in want.items():
        if parts[part].shape != shape or n % 8:
            raise KvedgeError(
                f"{where}: {part} is {list(parts[part].shape)}, {form.method} group size {g} with "
                f"scales {list(scales.shape)} gives {list(shape)}"
            )
    if form.method == "AWQ":
        order = np.argsort(AWQ_ORDER)  # column j of a word lies in field order[j]
        u = fields(qweight)[..., order].reshape(k, n)
        z = fields(qzeros)[..., order].reshape(groups, n)
    else:
        _check_groups(parts["g_idx"], k, g, where)
        u = fields(qweight).transpose(0, 2, 1).reshape(k, n)  # [K/8, N, 8] -> [K, N]
        words = qzeros.view(np.uint32) + (V1_ZEROS if form.zeros_less_one else np.uint32(0))
        z = fields(words).reshape(groups, n)
    scale = scales.astype(np.float32)
    offset = scale * (8 - z.astype(np.float32))
    q = (u.astype(np.int16) - 8).astype(np.int8)
    return QuantizedWeight(q, scale, offset if offset.any() else None, BITS, g, 0.0)


def fields(words: np.ndarray) -> np.ndarray:
    """int32 words [..., m] as their eight 4-bit fields [..., m, 8] uint8, the lowest first."""
    shifts = np.arange(0, 32, BITS, dtype=np.uint32)
    return ((words.view(np.uint32)[..., None] >> shifts) & np.uint32(0xF)).astype(np.uint8)


def _check_groups(g_idx: np.ndarray | None, k: int, g: int, where: str) -> None:
    """GPTQ's g_idx, where stored, must give input channel k the group k // g: blocks are runs of
    g channels, and a permuted order (desc_act) has no block form."""
    if g_idx is not None and not np.array_equal(g_idx.astype(np.int64), np.arange(k) // g):
        raise KvedgeError(
            f"{where}: g_idx is not k // {g} (input channels permuted, as desc_act does), which has "
            "no kvedge block form"
        )
