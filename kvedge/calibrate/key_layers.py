"""`kvedge calibrate --kv-dtype int4`: the layers whose keys the int4 cache keeps at 8 bits.

The int4 cache (kvedge/kv4.py) stores keys in 5 bits, and a few layers' keys cost far more than
the rest's; keeping those at 8 bits buys most of what 8-bit keys everywhere would (docs/
PERFORMANCE.md, "The KV cache at long context": the 4-bit study's per-layer costs, and the
cache with the layers this calibration chose against the study's).

Each KV layer's cost here: long prompts made of the calibration prompts (`long_prompts`: their
questions listed, CONTEXT tokens each) are teacher-forced as eval-kv does
(`kvedge.calibrate.evaluate`) with that layer's keys, and nothing else, rounded through the int4
form's 5-bit keys as each block of positions is committed (`FiveBitKeys`), and the mean KL
against the float32 cache is the layer's. Long, because the costly layers show at length: over
the short chat prompts themselves the ranking was another, with SmolLM2's costliest layer at
length far down it (docs/PERFORMANCE.md, same section).

The costliest tenth of the layers (at least one, `key8_count`) keep 8 bits: three of SmolLM2's
30. Each costs (8.5 - 5.25) / 2 bits a key value over the form's ~4.9 average, about 1% of the
cache per layer.

The report (`KEY_LAYERS_FILE`) carries a format version, the model's fingerprint and cache
geometry, the calibration set's hash, every layer's cost and the layers chosen; `kvedge export
--kv-dtype int4 --kv-key8-layers N ...` takes the layers it names (printed by the command).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvedge import __version__, kv4
from kvedge.calibrate.calibrate import Prompt, prompt_ids, prompts_hash
from kvedge.calibrate.evaluate import evaluate
from kvedge.errors import KvedgeError
from kvedge.quant import hadamard
from kvedge.runtime.model import Model

log = logging.getLogger(__name__)
ANSWER = "Answer each of these in turn, briefly.\n\n"
KEY_LAYERS_FORMAT = "kvedge-int4-key-layers"
KEY_LAYERS_VERSION = 1
KEY_LAYERS_FILE = "kv_int4_layers.json"
STEPS = 64  # teacher-forced positions per prompt
CONTEXT = 512  # tokens of each long prompt (at most the export's max_len - STEPS - 1)
LONG_PROMPTS = 4
MEMORY = 2 << 30  # bytes of float32 caches one pass may hold: layers are measured this many at a time


class FiveBitKeys:
    """A `KVCache.round_trip` hook: layer `layer`'s keys of each committed block replaced by their
    round trip through the int4 form's 5-bit keys (rotated by H, codes, rotated back)."""

    def __init__(self, layer: int, head_dim: int) -> None:
        self.layer, self.rotation = layer, hadamard(head_dim)

    def __call__(self, block: np.ndarray, start: int = 0) -> None:
        keys = block[self.layer, 0] @ self.rotation  # [kv_heads, n, d]
        codes, scales = kv4.quantize_keys(keys, 5)
        block[self.layer, 0] = kv4.dequantize_keys(codes, scales, 5) @ self.rotation.T


def key8_count(layers: int) -> int:
    """How many layers keep 8-bit keys: the costliest tenth, at least one."""
    return max(1, math.ceil(layers / 10))


@dataclass(frozen=True)
class KeyLayers:
    """What `key_layers` measured and chose (the report's fields)."""

    model_fingerprint: str
    geometry: dict
    calibration_hash: str
    calibration_prompts: int
    steps: int
    layer_kl: list[float]  # per KV layer: mean KL with only its keys at 5 bits
    key8_layers: list[int]  # the costliest key8_count, ascending
    format: str = KEY_LAYERS_FORMAT
    format_version: int = KEY_LAYERS_VERSION
    kvedge_version: str = __version__

    def save(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / KEY_LAYERS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True))
        tmp.replace(path)
        return path

    def export_flags(self) -> str:
        return " ".join(f"--kv-key8-layers {i}" for i in self.key8_layers)


def long_prompts(
    model: Model, prompts: list[Prompt], context: int, count: int = LONG_PROMPTS
) -> list[Prompt]:
    """`count` prompts of about `context` tokens from the short `prompts`: prompt i asks to answer
    their texts in turn, numbered, starting from the i-th of every `count` (wrapping around), as
    many as fit."""
    texts = [p["text"] if "text" in p else p["messages"][-1]["content"] for p in prompts]
    made = []
    for i in range(count):
        listed, n = [], i * len(texts) // count
        while True:
            line = f"{len(listed) + 1}. {texts[n % len(texts)]}"
            prompt = {"messages": [{"role": "user", "content": ANSWER + "\n".join([*listed, line])}]}
            if len(prompt_ids(model, prompt)) > context or len(listed) >= 4 * len(texts):
                break
            listed.append(line)
            n += 1
        if not listed:
            raise KvedgeError(f"context {context} is too short for a prompt of the calibration set")
        made.append({"messages": [{"role": "user", "content": ANSWER + "\n".join(listed)}]})
    return made


def key_layers(model: Model, prompts: list[Prompt], steps: int = STEPS, batch: int = 4) -> KeyLayers:
    """Each KV layer's cost with its keys at 5 bits over long prompts made of `prompts` (module
    docstring), and the layers to keep at 8 bits."""
    g = model.manifest.geometry
    if g.quantized or g.packed or g.dtype != "float32":
        raise KvedgeError(
            f"--kv-dtype int4 calibration reads the float32 cache: give a float32-cache export, not {g.dtype}"
        )
    try:
        g.with_dtype("int4")
    except KvedgeError as exc:
        raise KvedgeError(f"this model's cache cannot be int4: {exc}") from exc
    prompts = long_prompts(model, prompts, min(CONTEXT, g.max_len - steps - 1))
    per_pass = max(1, MEMORY // g.pool_bytes(batch))
    costs: list[float] = []
    passes = math.ceil(g.num_layers / per_pass)
    for n, first in enumerate(range(0, g.num_layers, per_pass), 1):
        layers = range(first, min(g.num_layers, first + per_pass))
        log.info(
            "layers %d..%d, their keys at 5 bits one at a time (pass %d of %d)", first, layers[-1], n, passes
        )
        hooks = tuple((f"layer {i}", FiveBitKeys(i, g.head_dim)) for i in layers)
        rows = evaluate(model, None, prompts, steps, schemes=(), batch=batch, simulated=hooks)
        costs += [row.kl_mean for row in rows]
    chosen = sorted(np.argsort(costs)[::-1][: key8_count(g.num_layers)].tolist())
    return KeyLayers(
        model_fingerprint=model.manifest.source_fingerprint,
        geometry=g.artifact_key(holds_cache=False),
        calibration_hash=prompts_hash(prompts),
        calibration_prompts=len(prompts),
        steps=steps,
        layer_kl=[round(c, 8) for c in costs],
        key8_layers=chosen,
    )
