"""INT8 KV quantization: the math, the schemes, and the threshold methods.

Symmetric INT8, no zero point, for a group of values x sharing one scale:

    scale = threshold / 127
    q     = clip(round_half_even(x / scale), -127, 127)          int8 (-128 is never used)
    x'    = q * scale                                             dequantized
    |x - x'| <= scale / 2  for |x| <= threshold; values beyond the threshold are clipped.

Granularity (the `Scheme`):

- K, `static-group`: one scale per (layer, kv head, group of `group_size` channels), fixed at
  calibration. Keys have outlier channels that stay put across tokens, so a per-channel-group
  scale keeps them from crushing the other channels.
- V, `dynamic-token`: one scale per (layer, kv head, token, channel group), computed from the
  token's own values when it is written (threshold = its absmax). Values have no stable
  outlier channels; a per-token scale follows each token's range.
- K or V, `dynamic-token` for K too: a per-token K scale beats a static per-channel-group one in
  KL divergence (docs/PERFORMANCE.md, "The INT8 cache: per token"); static K remains
  available because a static scale folds into the query at no cost in the graph.
- V, `static-group`: like K.
- `static-tensor` (K or V): one scale per layer for all heads and channels; the per-tensor INT8
  scheme TensorRT-LLM uses, kept as the baseline to compare against.

The INT8 cache in memory (`kvedge export --kv-dtype int8`, `CacheGeometry.dtype == "int8"`) stores
K and V both `dynamic-token`, the scheme that measured best: per (layer, kv head, token, group of
`group_size` channels) one float16 scale, so it needs no scales file. The graph quantizes each
new token's K (after RoPE) and V as it is computed and attends over the dequantized values, the
same values every later step reads back, so a cached run and a full re-prefill see identical K/V:

    s16   = float16(max(absmax(x_group) / 127, 2**-14))               the stored scale
    q     = int8(clip(round_half_even(x / float32(s16)), -127, 127))  the stored codes
    x'    = q * float32(s16)

`quantize_tokens` / `dequantize_tokens` below are the numpy twins of the graph's ops (used when a
sliding window re-rotates kept keys: dequantize, rotate, quantize again). The floor 2**-14 is
float16's smallest normal number, so no scale rounds to zero.

Threshold methods (static scales), over calibration samples of a group:

- `minmax`: threshold = max |x|.
- `percentile`: threshold = the p-th percentile of |x| (p = 99.99 by default).
- `mse`: threshold = a * max |x| for the a in [0.30, 1.00] (step 0.02) minimising the mean
  squared quantize-dequantize error.

Scales file (`kv_scales.npz`, written by `kvedge calibrate`):

    k_scale        [layers, kv_heads, head_dim / group_size]  float32  K static-group scales
    v_scale        [layers, kv_heads, head_dim / group_size]  float32  V static-group scales
    k_tensor_scale [layers]                                   float32  K static-tensor scales
    v_tensor_scale [layers]                                   float32  V static-tensor scales

with a JSON manifest beside it (`kv_scales.json`): format + version, method, group size, the
model's source fingerprint and cache geometry, the calibration-set hash and size, the sha256 of
the npz, and per-layer error statistics. Loading refuses scales made for another model or
geometry, naming both sides, and an npz whose bytes do not match its manifest.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvedge import __version__
from kvedge.contract import Manifest, sha256_files
from kvedge.contract.header import Header, check_header, decode_json, read_artifact
from kvedge.errors import ArtifactMismatch, KvedgeError

SCALES_FORMAT = "kvedge-kv-scales"
SCALES_VERSION = 1
SCALES_FILE = "kv_scales.npz"
SCALES_MANIFEST = "kv_scales.json"
SCALE_ARRAYS = ("k_scale", "v_scale", "k_tensor_scale", "v_tensor_scale")
RECALIBRATE = "run `kvedge calibrate` for this model"

QMAX = 127
BITS = (8, 4)  # a cached value's bits; 4 is simulated only (`Scheme.parse`, eval-kv --simulate)
ROTATIONS = ("none", "hadamard")
METHODS = ("minmax", "percentile", "mse")
K_MODES = ("static-group", "dynamic-token", "static-tensor")
V_MODES = ("dynamic-token", "static-group", "static-tensor")
GROUP_SIZES = (16, 32, 64, 128)
_TINY = np.float32(1e-8)  # floor for scales: an all-zero group must not divide by zero
SCALE_FLOOR = np.float32(2.0**-14)  # float16's smallest normal: stored scales never round to zero


@dataclass(frozen=True)
class Scheme:
    k: str = "static-group"
    v: str = "dynamic-token"
    group_size: int = 64  # channels per static scale (K, and V static-group): the calibration's
    v_group_size: int = 64  # channels per dynamic scale (K or V), one scale per token per group
    n_sink: int = 0  # the first n_sink positions of a sequence stay unquantized (attention sinks)
    bits: int = 8  # symmetric codes in [-(2**(bits-1) - 1), 2**(bits-1) - 1]
    rotation: str = "none"  # hadamard: K and V are quantized in a Hadamard basis of each head

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise KvedgeError(f"bits {self.bits!r} is not allowed; allowed: {list(BITS)}")
        if self.rotation not in ROTATIONS:
            raise KvedgeError(f"rotation {self.rotation!r} is not allowed; allowed: {list(ROTATIONS)}")
        if (self.bits != 8 or self.rotation != "none") and not self.dynamic:
            raise KvedgeError(
                f"a {self.bits}-bit or rotated scheme quantizes K and V dynamic-token only, "
                f"not K {self.k}, V {self.v}"
            )
        if self.v_group_size not in GROUP_SIZES:
            raise KvedgeError(
                f"V group size {self.v_group_size!r} is not allowed; allowed: {list(GROUP_SIZES)}"
            )
        if self.k not in K_MODES:
            raise KvedgeError(f"K mode {self.k!r} is not allowed; allowed: {list(K_MODES)}")
        if self.v not in V_MODES:
            raise KvedgeError(f"V mode {self.v!r} is not allowed; allowed: {list(V_MODES)}")
        if not isinstance(self.n_sink, int) or not 0 <= self.n_sink <= 64:
            raise KvedgeError(f"n_sink {self.n_sink!r} is not allowed; allowed: 0..64")
        if self.group_size not in GROUP_SIZES:
            raise KvedgeError(f"group size {self.group_size!r} is not allowed; allowed: {list(GROUP_SIZES)}")

    @property
    def dynamic(self) -> bool:
        """Both K and V scaled per token: no scales file needed."""
        return self.k == self.v == "dynamic-token"

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def name(self) -> str:
        v_group = self.v_group_size if self.v == "dynamic-token" else self.group_size
        k_group = f" g{self.group_size}" if self.k == "static-group" else ""
        v_group = f" g{v_group}" if self.v != "static-tensor" else ""
        sinks = f", {self.n_sink} sinks fp32" if self.n_sink else ""
        bits = f"int{self.bits} " if self.bits != 8 else ""
        rotation = f", {self.rotation}" if self.rotation != "none" else ""
        return f"{bits}K {self.k}{k_group}, V {self.v}{v_group}{rotation}{sinks}"

    @classmethod
    def parse(cls, spec: str) -> Scheme:
        """A per-token scheme from its short name, dash-separated: the bits (`int8` or `int4`), then
        any of `gN` (channels per scale, default 32), `hadamard`, `sinksN` (the first N positions
        kept float32); e.g. `int4-g16-hadamard-sinks4`."""
        allowed = "int8|int4, then any of gN, hadamard, sinksN (e.g. int4-g16-hadamard-sinks4)"
        first, *rest = spec.split("-")
        if first not in ("int8", "int4"):
            raise KvedgeError(f"scheme {spec!r} is not allowed; allowed: {allowed}")
        fields: dict[str, Any] = {"bits": int(first[3:]), "group_size": 32}
        for part in rest:
            number = re.fullmatch(r"(g|sinks)(\d+)", part)
            if part == "hadamard":
                fields["rotation"] = "hadamard"
            elif number:
                fields["group_size" if number[1] == "g" else "n_sink"] = int(number[2])
            else:
                raise KvedgeError(f"scheme {spec!r}: {part!r} is not allowed; allowed: {allowed}")
        group = fields.pop("group_size")
        return cls(k="dynamic-token", v="dynamic-token", group_size=group, v_group_size=group, **fields)


def quantize(x: np.ndarray, scale: np.ndarray, qmax: int = QMAX) -> np.ndarray:
    """int8 codes of `x` for a broadcastable `scale` (in [-qmax, qmax]: 7 for 4-bit codes)."""
    return np.clip(np.rint(x / scale), -qmax, qmax).astype(np.int8)


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale


def grouped(x: np.ndarray, group_size: int) -> np.ndarray:
    """[..., d] -> [..., d / group_size, group_size]."""
    d = x.shape[-1]
    if d % group_size:
        raise KvedgeError(f"group size {group_size} does not divide head_dim {d}")
    return x.reshape(*x.shape[:-1], d // group_size, group_size)


def expand(scale: np.ndarray, group_size: int) -> np.ndarray:
    """Per-group scales [..., groups] -> per-channel [..., groups * group_size]."""
    return np.repeat(scale, group_size, axis=-1)


def dynamic_scales(x: np.ndarray, group_size: int) -> np.ndarray:
    """Per-token scales of `x` [..., d] -> [..., d / group_size] (threshold = the group's absmax)."""
    return np.maximum(np.abs(grouped(x, group_size)).max(axis=-1) / QMAX, _TINY).astype(np.float32)


def quantize_tokens(x: np.ndarray, group_size: int, qmax: int = QMAX) -> tuple[np.ndarray, np.ndarray]:
    """INT8 cache codes of `x` [..., d] float32 -> (codes [..., d] int8, scales [..., d/g] float16)
    (`qmax` 7: 4-bit codes, each in an int8)."""
    x = np.asarray(x, np.float32)
    absmax = np.abs(grouped(x, group_size)).max(axis=-1)
    scales = np.maximum(absmax / np.float32(qmax), SCALE_FLOOR).astype(np.float16)
    return quantize(x, expand(scales.astype(np.float32), group_size), qmax), scales


def hadamard(d: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order `d` (a power of 2): x @ H spreads a
    channel's outlier over all channels, and (q H)(k H)^T = q k^T."""
    if d < 1 or d & (d - 1):
        raise KvedgeError(f"a Hadamard rotation needs a power-of-2 head_dim, not {d}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


def dequantize_tokens(codes: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """Inverse of `quantize_tokens`: codes [..., d] int8, scales [..., d/g] float16 -> float32."""
    return dequantize(codes, expand(scales.astype(np.float32), group_size))


def thresholds(samples: np.ndarray, group_size: int, method: str, percentile: float = 99.99) -> np.ndarray:
    """Static thresholds per (kv head, channel group) from `samples` [tokens, kv_heads, d]."""
    if method not in METHODS:
        raise KvedgeError(f"method {method!r} is not allowed; allowed: {list(METHODS)}")
    # [kv_heads, groups, tokens * group_size]: every value a group's scale must cover
    g = (
        grouped(samples, group_size)
        .transpose(1, 2, 0, 3)
        .reshape(samples.shape[1], -1, samples.shape[0] * group_size)
    )
    mags = np.abs(g)
    if method == "minmax":
        return mags.max(axis=-1)
    if method == "percentile":
        return np.percentile(mags, percentile, axis=-1).astype(np.float32)
    absmax = mags.max(axis=-1)
    best, best_err = absmax, np.full(absmax.shape, np.inf)
    for alpha in np.arange(0.30, 1.0001, 0.02):
        t = np.maximum(absmax * alpha, _TINY * QMAX)
        s = (t / QMAX)[..., None]
        err = ((dequantize(quantize(g, s), s) - g) ** 2).mean(axis=-1)
        better = err < best_err
        best, best_err = np.where(better, t, best), np.where(better, err, best_err)
    return best.astype(np.float32)


def tensor_threshold(samples: np.ndarray, method: str, percentile: float = 99.99) -> float:
    """One static threshold for a whole layer's K or V (the per-tensor baseline)."""
    flat = samples.reshape(-1, 1, 1)  # one head, one group
    return float(thresholds(flat, 1, method, percentile)[0, 0])


def scales_from_thresholds(t: np.ndarray) -> np.ndarray:
    return np.maximum(np.asarray(t, np.float32) / QMAX, _TINY)


def roundtrip_error(x: np.ndarray, scale: np.ndarray) -> tuple[float, float]:
    """(relative L2 error, max abs error) of quantize-dequantize of `x` with `scale`."""
    back = dequantize(quantize(x, scale), scale)
    rel = float(np.linalg.norm(back - x) / max(np.linalg.norm(x), 1e-12))
    return rel, float(np.abs(back - x).max())


@dataclass(frozen=True)
class ScalesManifest:
    method: str
    group_size: int
    model_fingerprint: str
    geometry: dict[str, Any]
    calibration_hash: str
    calibration_prompts: int
    calibration_tokens: int
    npz_sha256: str
    layer_errors: dict[str, list[float]] = field(default_factory=dict)  # e.g. "k_rel": [per layer]
    format: str = SCALES_FORMAT
    format_version: int = SCALES_VERSION
    kvedge_version: str = __version__


@dataclass(frozen=True)
class Scales:
    """Calibrated static scales for one model (see the module docstring for shapes)."""

    manifest: ScalesManifest
    k_scale: np.ndarray  # [layers, kv_heads, groups] float32
    v_scale: np.ndarray  # [layers, kv_heads, groups] float32
    k_tensor_scale: np.ndarray  # [layers] float32
    v_tensor_scale: np.ndarray  # [layers] float32

    @property
    def fingerprint(self) -> str:
        return self.manifest.npz_sha256

    def save(self, folder: Path) -> None:
        """Write the npz and its manifest; the manifest last, so a partial write never loads."""
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (SCALES_FILE + ".tmp.npz")
        np.savez(tmp, **{name: getattr(self, name) for name in SCALE_ARRAYS})
        tmp.replace(folder / SCALES_FILE)
        manifest = dataclasses.replace(self.manifest, npz_sha256=sha256_files([folder / SCALES_FILE]))
        (folder / SCALES_MANIFEST).write_text(
            json.dumps(dataclasses.asdict(manifest), indent=2, sort_keys=True)
        )

    @classmethod
    def load(cls, folder: Path, model: Manifest) -> Scales:
        """Load scales from `folder` and refuse them unless they were made for `model`."""
        folder = Path(folder)
        path = folder / SCALES_MANIFEST
        if not path.is_file():
            raise KvedgeError(f"{folder}: no {SCALES_MANIFEST}; run `kvedge calibrate` first")
        data = decode_json(path.read_bytes(), str(path))
        kind = Header(SCALES_FORMAT, SCALES_VERSION)
        manifest = read_artifact(data, ScalesManifest, kind, str(path), RECALIBRATE)
        found = Header(
            manifest.format,
            manifest.format_version,
            model=manifest.model_fingerprint,
            geometry=manifest.geometry,
        )
        expected = Header(
            SCALES_FORMAT,
            SCALES_VERSION,
            model=model.source_fingerprint,
            geometry=model.geometry.artifact_key(holds_cache=False),
        )
        check_header(str(path), found, expected, RECALIBRATE)
        npz = folder / SCALES_FILE
        if not npz.is_file() or sha256_files([npz]) != manifest.npz_sha256:
            raise ArtifactMismatch(f"{npz}: missing or does not match its manifest (corrupt or replaced)")
        with np.load(npz) as arrays:
            values = {name: arrays[name].astype(np.float32) for name in SCALE_ARRAYS}
        layers, heads = model.geometry.num_layers, model.geometry.num_kv_heads
        groups = model.geometry.head_dim // manifest.group_size
        if values["k_scale"].shape != (layers, heads, groups) or values["v_scale"].shape != (
            layers,
            heads,
            groups,
        ):
            raise ArtifactMismatch(
                f"{npz}: scale shapes {values['k_scale'].shape} do not match {(layers, heads, groups)}"
            )
        return cls(manifest=manifest, **values)


class RoundTrip:
    """Replaces freshly written K/V with their round trip under `scheme` (in place).

    Applied to each block of new tokens as it enters the cache, this gives exactly the values
    an INT8 cache with the same scales would dequantize to, so quality can be measured for
    any scheme on the fp32 buffers. Per-token scales are stored float16, as the INT8 cache's are
    (`quantize_tokens`); a rotated scheme quantizes x H and gives back its round trip times H^T
    (a graph would keep K and V rotated, rotate each query by H and each head's output by H^T:
    the same products). Tokens of a block attend to its own unquantized K/V in the graph that
    computed them: within a prefill chunk the simulation is a little kinder than a real cache.
    """

    def __init__(self, scheme: Scheme, scales: Scales | None) -> None:
        if scales is None and not scheme.dynamic:
            raise KvedgeError(f"scheme {scheme.name!r} needs calibrated scales (kvedge calibrate)")
        if (
            scales is not None
            and scheme.group_size != scales.manifest.group_size
            and "static-group"
            in (
                scheme.k,
                scheme.v,
            )
        ):
            raise KvedgeError(
                f"scheme group size {scheme.group_size} differs from the scales' {scales.manifest.group_size}"
            )
        self.scheme = scheme
        self.rotation: np.ndarray | None = None  # [d, d], set at the first block (head_dim known)
        self.k_scale = (
            None
            if scheme.k == "dynamic-token"
            else self._static(scheme.k, scales.k_scale, scales.k_tensor_scale)
        )
        self.v_scale = (
            None
            if scheme.v == "dynamic-token"
            else self._static(scheme.v, scales.v_scale, scales.v_tensor_scale)
        )

    def _static(self, mode: str, group: np.ndarray, tensor: np.ndarray) -> np.ndarray:
        if mode == "static-tensor":
            return tensor.reshape(-1, 1, 1, 1)  # [layers, 1, 1, 1]
        return expand(group, self.scheme.group_size)[:, :, None, :]  # [layers, kv_heads, 1, d]

    def __call__(self, block: np.ndarray, start: int = 0) -> None:
        """`block` [layers, 2, kv_heads, n, head_dim]: the K and V of positions start..start+n-1,
        rewritten in place (positions below `n_sink` are kept as they are)."""
        skip = max(0, self.scheme.n_sink - start)
        if skip >= block.shape[3]:
            return
        block = block[:, :, :, skip:]
        if self.scheme.dynamic and (self.scheme.bits != 8 or self.scheme.rotation != "none"):
            if self.scheme.rotation == "hadamard" and self.rotation is None:
                self.rotation = hadamard(block.shape[-1])
            x = block if self.rotation is None else block @ self.rotation
            codes, scales = quantize_tokens(x, self.scheme.v_group_size, self.scheme.qmax)
            back = dequantize_tokens(codes, scales, self.scheme.v_group_size)
            block[...] = back if self.rotation is None else back @ self.rotation.T
            return
        for index, scale in ((0, self.k_scale), (1, self.v_scale)):
            x = block[:, index]
            if scale is None:
                group = self.scheme.v_group_size
                scale = expand(dynamic_scales(x, group), group)
            x[...] = dequantize(quantize(x, scale), scale)
