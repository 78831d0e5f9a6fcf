"""`ExportRecipe`: every choice `kvedge export` makes, in one frozen type.

The CLI's export flags, the planner's forms (`kvedge plan --weights ...`), the `export:` section of
configs/models and the benchmark's systems all parse into it, and the graph builder reads it, so
a rule such as "the LM head of an ort graph is never stored below 8 bits" is written once, here,
as a property. Invalid combinations fail when the recipe is made, naming the flag, the value and
what is allowed. Fields take the names of `kvedge export`'s flags (`--head-bits` is `head_bits`);
a property says what a field left None comes to (`lm_head_bits`, `kept_channels`, `decode`). A
field's type says what a YAML file may give it (configs/models' `export:` section is read with
these types); `__post_init__` checks the rest, combinations included.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Literal, get_args, get_origin

from msgspec import Meta

from kvedge.contract.manifest import (
    DECODE_MATMULS,
    EXPORTED_KV_DTYPES,
    KV_GROUP_SIZES,
    LOGITS_MODES,
    PACKED_KV_DTYPES,
    PRECISIONS,
    QUANT_MATMUL_OP,
    QUANTIZED_KV_DTYPES,
    VARIANTS,
    WEIGHT_FORMATS,
    export_kv_dtypes,
    export_weight_formats,
    kvedge_ops,
)
from kvedge.declare import Flag, declared, strip
from kvedge.errors import KvedgeError

BLOCK_SIZES = (16, 32, 64, 128, 256)  # input features per quantization block
# input channels per quantized matmul kept float (kvedge.export.quantize's docstring); each kept
# channel stores and reads one float row of N per matmul. An ort graph keeps 32: onnxruntime's CPU
# kernel rounds its activations to int8 per block, and one large channel coarsens its block. A
# portable graph computes weight-only (TensorRT's float activations; on the CPU its product inputs
# are split in two parts the int8 grid holds, `kvedge.export.graph.quant_matmul._product`): a kept
# channel then only spares its weight row the grid's rounding, which 8 take most of for a quarter
# of 32's bytes, and over a source's own blocks, its weights exactly, none is kept
# (`ExportRecipe.kept_channels_of`). docs/PERFORMANCE.md, "Quantized weights" and "Activations of
# portable quantized graphs", has the measurements.
OUTLIER_CHANNELS = 32
WEIGHT_ONLY_OUTLIER_CHANNELS = 8
OUTLIER_CHOICES = (0, 8, 16, 32, 64)
# The LM head is never stored below 8 bits unless --head-bits 4 says so: at 4 bits it alone costs
# most of an int4 export's error, on the CPU and weight-only (as TensorRT computes) alike, for a
# fifth of SmolLM2's bytes (its tied table is the head): docs/PERFORMANCE.md, "Quantized weights".
# TensorRT takes an int8 head beside int4 projections (tests/tensorrt_claims.py).
HEAD_MIN_BITS = 8
HEAD_BITS = (8, 4)
MAX_LEN_RANGE = (16, 131072)
# the fields that say how the weights are stored and computed (`kvedge plan`'s form options)
WEIGHT_FORM_KEYS = (
    "weights",
    "variant",
    "precision",
    "block_size",
    "outlier_channels",
    "head_bits",
    "decode_matmuls",
)


@dataclass(frozen=True)
class ExportRecipe:
    """What `kvedge export` makes. `weights` and `kv_dtype` left None take the precision's default
    (`export_weight_formats`, `export_kv_dtypes`): float32 for a float32 graph, float16 for a
    float16 one; after construction both are always set."""

    max_len: Annotated[
        int, Meta(ge=MAX_LEN_RANGE[0]), Flag("Cache length (tokens) per sequence, baked into the graph.")
    ] = 2048
    logits: Annotated[
        Literal[LOGITS_MODES],
        Flag(
            "rows: logits at the positions the runtime asks for (the last prompt token; every "
            "proposed token of a speculative step); last: the last position only (no speculative "
            "decoding); all: every position."
        ),
    ] = "rows"
    variant: Annotated[
        str,
        Flag(
            "portable: standard ONNX ops (TensorRT); ort: onnxruntime fused attention, cache "
            "written in place.",
            choices=tuple(sorted(VARIANTS)),
        ),
    ] = "portable"
    precision: Annotated[
        str,
        Flag(
            "The dtype the graph computes in. float16: --variant portable only, weights and "
            "activations float16 with RMSNorm, softmax and the logits output in float32, for "
            "TensorRT's strongly typed engines; its cache is float16 or int8.",
            choices=PRECISIONS,
        ),
    ] = "float32"
    weights: Annotated[
        str | None,
        Flag(
            "Weight storage: float, or weight-only blocked quantization (int8, int4) of the "
            "projections and LM head. Default: the precision's (float32; float16 with --precision "
            "float16).",
            choices=tuple(sorted(WEIGHT_FORMATS)),
        ),
    ] = None
    block_size: Annotated[
        int, Flag("Quantization block size: input features per scale.", choices=BLOCK_SIZES)
    ] = 32
    outlier_channels: Annotated[
        int | None,
        Flag(
            "int8/int4 weights: input channels of each matmul kept float (default 32, 8 with "
            "--variant portable, none there where every matrix is the source's own blocks). Fewer "
            "read fewer bytes per token, at some quality (docs/PERFORMANCE.md).",
            choices=OUTLIER_CHOICES,
        ),
    ] = None
    head_bits: Annotated[
        int | None,
        Flag(
            "int8/int4 weights: the LM head's bits (--variant ort: 8 or 4; portable: the weights' "
            "bits or 8). Default: at least 8 (a 4-bit head costs 20-35x the KL, docs/PERFORMANCE.md).",
            choices=HEAD_BITS,
        ),
    ] = None
    decode_matmuls: Annotated[
        str | None,
        Flag(
            "--variant ort --weights int8|int4: kvedge (default) runs a decode step's matmuls in "
            "kvedge's own kernel, in a second form of the graph: faster decode, the weights held "
            "twice in memory; onnxruntime runs every step in MatMulNBits, one copy "
            "(docs/PERFORMANCE.md).",
            choices=DECODE_MATMULS,
        ),
    ] = None
    kv_dtype: Annotated[
        str | None,
        Flag(
            "KV cache dtype. Default: the precision's (float32; float16 with --precision float16). "
            "int8: codes plus a float16 scale per token per channel group (with --variant ort it "
            "runs kvedge's own attention kernel, built at install). float16: a float16 graph's, or "
            "with --variant ort the in-place form for --device cuda.",
            choices=tuple(EXPORTED_KV_DTYPES),
        ),
    ] = None
    kv_group_size: Annotated[
        int,
        Flag(
            "int8 cache: channels per scale per token (16, 32, 64, 128 up to head_dim; 0: "
            "CacheGeometry.default_group_size, 32).",
            choices=(0, *KV_GROUP_SIZES),
            allowed=f"{', '.join(map(str, KV_GROUP_SIZES))} (0: the default)",
        ),
    ] = 0
    kv_key8_layers: Annotated[
        tuple[int, ...],
        Flag(
            "int4 cache: a KV layer whose keys keep 8-bit codes (repeat for several): the layers "
            "`kvedge calibrate --kv-dtype int4` names (SmolLM2-135M's: 18, 23, 25).",
            metavar="LAYER",
        ),
    ] = ()

    def __post_init__(self) -> None:
        low, high = MAX_LEN_RANGE
        if not isinstance(self.max_len, int) or not low <= self.max_len <= high:
            raise KvedgeError(f"--max-len {self.max_len!r} is out of range; allowed: {low}..{high}")
        self._check_choices()
        # frozen: the defaults are filled in once, here, before anything reads them
        if self.weights is None:
            object.__setattr__(self, "weights", export_weight_formats(self.precision)[0])
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", export_kv_dtypes(self.variant, self.precision)[0])
        if self.weights not in WEIGHT_FORMATS:
            raise KvedgeError(f"--weights {self.weights!r} is not allowed; allowed: {sorted(WEIGHT_FORMATS)}")
        self._check_precision()
        self._check_quantized_flags()
        check_kv_dtype(self.kv_dtype, self.variant, self.precision)
        if self.decode_matmuls == "kvedge" and self.kv_dtype == "float16":
            raise KvedgeError(
                "--decode-matmuls kvedge runs on the CPU; the float16 cache is the CUDA form, whose "
                "decode steps run MatMulNBits (allowed there: onnxruntime)"
            )
        if self.kv_dtype not in QUANTIZED_KV_DTYPES and self.kv_group_size:
            raise KvedgeError(f"--kv-group-size {self.kv_group_size} applies to --kv-dtype int8 only")
        if not all(isinstance(i, int) and i >= 0 for i in self.kv_key8_layers):
            raise KvedgeError(
                f"--kv-key8-layers {list(self.kv_key8_layers)!r}: allowed: layer indices (integers >= 0)"
            )
        object.__setattr__(self, "kv_key8_layers", tuple(sorted(set(self.kv_key8_layers))))
        if self.kv_dtype not in PACKED_KV_DTYPES and self.kv_key8_layers:
            raise KvedgeError(f"--kv-key8-layers {list(self.kv_key8_layers)} applies to --kv-dtype int4 only")

    def _check_choices(self) -> None:
        """Each field against its declared values (`Flag.choices`, a `Literal`), but those whose
        allowed values depend on others, checked after: --head-bits (`_check_quantized_flags`),
        --weights (the precision's) and --kv-dtype (`check_kv_dtype`)."""
        for option in declared(ExportRecipe).values():
            hint = strip(option.hint)
            allowed = option.flag.choices or (get_args(hint) if get_origin(hint) is Literal else ())
            value = getattr(self, option.key)
            if option.key in ("head_bits", "weights", "kv_dtype"):
                continue
            if allowed and value is not None and value not in allowed:
                said = option.flag.allowed or list(allowed)
                raise KvedgeError(f"{option.flag_name} {value!r} is not allowed; allowed: {said}")

    def _check_precision(self) -> None:
        if self.half and self.variant != "portable":
            raise KvedgeError(
                f"--precision float16 is built for --variant portable only (the graph TensorRT "
                f"builds strongly typed); --variant {self.variant} computes in float32 (its float16 "
                "form for onnxruntime's CUDA provider is --kv-dtype float16); allowed with "
                f"--variant {self.variant}: --precision float32"
            )
        allowed = export_weight_formats(self.precision)
        if self.weights not in allowed:
            raise KvedgeError(
                f"--weights {self.weights} is not allowed with --precision {self.precision}: a float16 "
                f"graph computes with float16 weights, float32 storage would only be cast down; "
                f"allowed: {list(allowed)}"
            )

    def _check_quantized_flags(self) -> None:
        """The flags that apply to int8/int4 weights only, and --head-bits' per-variant choices."""
        for flag, value in (("--outlier-channels", self.outlier_channels), ("--head-bits", self.head_bits)):
            if value is not None and not self.quantized:
                raise KvedgeError(
                    f"{flag} {value!r} applies to --weights int8 or int4 only, not --weights {self.weights}"
                )
        if self.decode_matmuls is not None and not (self.quantized and self.variant == "ort"):
            raise KvedgeError(
                f"--decode-matmuls {self.decode_matmuls!r} applies to --variant ort --weights int8 or "
                f"int4 only, not --variant {self.variant} --weights {self.weights}"
            )
        if self.head_bits is not None:
            allowed = [b for b in HEAD_BITS if b >= self.bits]  # never below the projections' bits
            if self.variant == "ort":
                allowed = list(HEAD_BITS)
            if self.head_bits not in allowed:
                raise KvedgeError(
                    f"--head-bits {self.head_bits!r} is not allowed with --variant {self.variant} "
                    f"--weights {self.weights}; allowed: {allowed}"
                )

    @property
    def half(self) -> bool:
        """The graph computes in float16 (`--precision float16`)."""
        return self.precision == "float16"

    @property
    def bits(self) -> int:
        return WEIGHT_FORMATS[self.weights]

    @property
    def quantized(self) -> bool:
        """Blocked integer weights (int8, int4), as opposed to float storage."""
        return self.bits < 16

    @property
    def lm_head_bits(self) -> int:
        """The bits the LM head is stored at: --head-bits, else never below `HEAD_MIN_BITS`."""
        return max(self.bits, HEAD_MIN_BITS) if self.head_bits is None else self.head_bits

    @property
    def kept_channels(self) -> int:
        """Input channels of each quantized matmul kept float: --outlier-channels, else
        `OUTLIER_CHANNELS` in an ort graph, `WEIGHT_ONLY_OUTLIER_CHANNELS` in a portable one; 0 for
        float weights."""
        if not self.quantized:
            return 0
        if self.outlier_channels is not None:
            return self.outlier_channels
        return WEIGHT_ONLY_OUTLIER_CHANNELS if self.variant == "portable" else OUTLIER_CHANNELS

    def kept_channels_of(self, source_blocks_only: bool) -> int:
        """`kept_channels` of an export whose quantized matrices are, or are not, all the source's
        own blocks (`source_blocks_only`: a GGUF, AWQ or GPTQ file's, none requantized). A portable
        graph then keeps none unless --outlier-channels asks: it computes weight-only, so a kept
        channel only spares its weight row the grid's rounding, and the source's blocks are its
        weights exactly."""
        if source_blocks_only and self.variant == "portable" and self.outlier_channels is None:
            return 0
        return self.kept_channels

    @property
    def decode(self) -> str:
        """What a decode step's quantized matmuls run (`DECODE_MATMULS`): --decode-matmuls, else
        kvedge's op in ort int8/int4 graphs; "" for graphs it does not apply to."""
        if not (self.quantized and self.variant == "ort"):
            return ""
        return self.decode_matmuls or "kvedge"

    @property
    def two_forms(self) -> bool:
        """The graph holds its quantized weights twice: a prefill form (MatMulNBits) and a decode
        form (kvedge.QuantMatMul), where `kvedge_ops` puts the op: not over the float16 cache, the
        CUDA form, whose decode steps run MatMulNBits."""
        return QUANT_MATMUL_OP in kvedge_ops(self.variant, self.kv_dtype, self.weights, self.decode)

    def flags(self) -> str:
        """The `kvedge export` flags that make this recipe, each default left out, in field order:
        `--weights` and `--kv-dtype` are compared with the defaults of its --precision."""
        plain = ExportRecipe()
        same_graph = ExportRecipe(variant=self.variant, precision=self.precision)
        parts = []
        for field in fields(self):
            value = getattr(self, field.name)
            default = getattr(plain if field.name in ("variant", "precision") else same_graph, field.name)
            if value != default:
                parts.append(f"--{field.name.replace('_', '-')} {value}")
        return " ".join(parts)

    def describe_weights(self) -> str:
        """The weights' form in a few words, as `kvedge plan` prints it."""
        if not self.quantized:
            return self.weights
        text = (
            f"{self.weights} {self.variant} (block {self.block_size}, {self.kept_channels} "
            f"{self.precision} channels"
        )
        if self.lm_head_bits != self.bits:
            text += f", int{self.lm_head_bits} head"
        return text + (", prefill and decode forms)" if self.two_forms else ")")


def check_kv_dtype(kv_dtype: str, variant: str = "portable", precision: str = "float32") -> None:
    """Refuse a cache dtype the `variant` graph computing in `precision` cannot be built with,
    naming the allowed ones (`export_kv_dtypes`)."""
    allowed = list(export_kv_dtypes(variant, precision))
    if kv_dtype in allowed:
        return
    if kv_dtype not in EXPORTED_KV_DTYPES:
        raise KvedgeError(
            f"--kv-dtype {kv_dtype!r} is not allowed with --variant {variant}; allowed: {allowed}"
        )
    if kv_dtype in PACKED_KV_DTYPES:
        raise KvedgeError(
            f"--kv-dtype {kv_dtype} runs kvedge's own CPU attention kernel (Int4CacheAttention), so "
            f"--variant ort with float32 compute only: TensorRT and the portable graph have no 4-bit "
            f"cache; with --variant {variant} --precision {precision}, allowed: {allowed}"
        )
    if precision == "float16":
        raise KvedgeError(
            f"--kv-dtype {kv_dtype} is not allowed with --precision float16: the cache of a float16 "
            f"graph holds float16 values (or int8 codes); allowed: {allowed}"
        )
    raise KvedgeError(
        f"--kv-dtype {kv_dtype} with float32 compute is built for --variant ort only (the onnxruntime "
        f"CUDA in-place form; --precision float16 makes a portable float16 graph over a float16 "
        f"cache); with --variant {variant}, allowed: {allowed}"
    )
