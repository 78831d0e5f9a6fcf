"""`kvedge calibrate`: run the fp model over a calibration set and write INT8 KV scales.

The math, schemes, methods and the scales file format are in `kvedge.quant`. Here:

1. Read the calibration set: the built-in default (`data/calibration.jsonl`, 68 varied chat
   prompts) or the user's file (.jsonl lines of {"messages": [...]} or {"text": "..."}, or
   .txt with one prompt per non-empty line).
2. Prefill each prompt (rendered with the chat template) into an empty cache slot and collect
   every layer's K (after RoPE, as cached) and V for its tokens.
3. Per layer: static thresholds per (kv head, channel group) and per tensor, by `method`;
   per-layer round-trip errors (relative L2, max abs) for K static-group, V dynamic-token and
   V static-group.
4. Refuse NaN/inf anywhere; write nothing unless everything succeeded.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvedge.errors import KvedgeError
from kvedge.quant import (
    METHODS,
    Scales,
    ScalesManifest,
    dynamic_scales,
    expand,
    roundtrip_error,
    scales_from_thresholds,
    tensor_threshold,
    thresholds,
)
from kvedge.runtime.generate import prefill
from kvedge.runtime.model import Model

log = logging.getLogger(__name__)

Prompt = dict[str, Any]  # {"messages": [...]} or {"text": "..."}


def builtin_prompts(name: str = "calibration") -> list[Prompt]:
    """A prompt set shipped with kvedge: "calibration" (68 prompts) or "heldout" (24)."""
    text = resources.files("kvedge.calibrate").joinpath("data", f"{name}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


SUMMARIZE = "Summarize the following document.\n\n"


def builtin_documents() -> list[dict[str, str]]:
    """The long documents shipped for quality at long context (`data/documents.jsonl`: the GPL
    version 3, verbatim, and three sections of Python's reference documentation; each line says
    its source and licence): {"title", "source", "licence", "text"}."""
    text = resources.files("kvedge.calibrate").joinpath("data", "documents.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def document_prompts(model: Model, context: int) -> list[Prompt]:
    """One chat prompt per built-in document: "Summarize the following document." and as much of
    the document, cut at a space or line break, as keeps the templated prompt within `context`
    tokens (the longest such cut: prompts end within a word or two of `context`)."""
    prompts = []
    for document in builtin_documents():
        text = document["text"]
        cuts = [i for i, c in enumerate(text) if c in " \n"] + [len(text)]

        def prompt(n: int, text: str = text) -> Prompt:
            return {"messages": [{"role": "user", "content": SUMMARIZE + text[:n].rstrip()}]}

        low, high = 0, len(cuts) - 1  # the longest cut that fits lies in cuts[low:high + 1]
        if len(prompt_ids(model, prompt(cuts[0]))) > context:
            raise KvedgeError(f"context {context} is too short for a document prompt")
        while low < high:
            middle = (low + high + 1) // 2
            if len(prompt_ids(model, prompt(cuts[middle]))) <= context:
                low = middle
            else:
                high = middle - 1
        if low == len(cuts) - 1 and len(prompt_ids(model, prompt(len(text)))) < context * 0.98:
            raise KvedgeError(
                f"context {context}: the document {document['title']!r} is only "
                f"{len(prompt_ids(model, prompt(len(text))))} tokens long as a prompt"
            )
        prompts.append(prompt(cuts[low]))
    return prompts


def read_prompts(path: str | Path | None, default: str = "calibration") -> list[Prompt]:
    """Prompts from `path` (.jsonl or .txt), or the built-in set when `path` is None."""
    if path is None:
        return builtin_prompts(default)
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KvedgeError(f"calibration set {str(path)!r} is unreadable ({exc})") from exc
    prompts: list[Prompt] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KvedgeError(f"{path}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(item, dict) or not (
                isinstance(item.get("text"), str) or isinstance(item.get("messages"), list)
            ):
                raise KvedgeError(f'{path}:{n}: each line needs "text" (string) or "messages" (list)')
            prompts.append(item)
    elif path.suffix == ".txt":
        prompts = [
            {"messages": [{"role": "user", "content": line.strip()}]}
            for line in text.splitlines()
            if line.strip()
        ]
    else:
        raise KvedgeError(f"calibration set {str(path)!r}: use a .jsonl or .txt file")
    if not prompts:
        raise KvedgeError(f"calibration set {str(path)!r} is empty")
    return prompts


def prompt_ids(model: Model, prompt: Prompt) -> list[int]:
    if "text" in prompt:
        return model.tokenizer.encode(prompt["text"])
    return model.tokenizer.encode_chat(prompt["messages"])


def prompts_hash(prompts: list[Prompt]) -> str:
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()


def collect_kv(
    model: Model, prompts: list[Prompt], max_tokens: int = 16384
) -> tuple[np.ndarray, np.ndarray, int]:
    """K and V of every calibration token: two arrays [layers, tokens, kv_heads, head_dim]."""
    ring_layers = model.manifest.geometry.ring_layers
    if ring_layers:  # their rings keep only the last positions of a prompt
        raise KvedgeError(
            f"calibration is not supported for models with sliding-window ring layers "
            f"(layers {list(ring_layers)}, Gemma 3): the cache keeps only their last positions"
        )
    keys, values, total = [], [], 0
    for prompt in tqdm(prompts, desc="calibrate", unit="prompt"):
        ids = prompt_ids(model, prompt)[: model.manifest.geometry.max_len]
        if total + len(ids) > max_tokens:
            break
        model.cache.reset(0)
        prefill(model.backend, model.cache, 0, [ids])
        block = model.cache.read(0, len(ids)).kv  # [layers, 2, kv_heads, n, d]
        keys.append(block[:, 0].transpose(0, 2, 1, 3))
        values.append(block[:, 1].transpose(0, 2, 1, 3))
        total += len(ids)
    model.cache.reset(0)
    k, v = np.concatenate(keys, axis=1), np.concatenate(values, axis=1)
    if not (np.isfinite(k).all() and np.isfinite(v).all()):
        raise KvedgeError("the model produced NaN or inf K/V on the calibration set; no scales written")
    return k, v, total


@dataclass(frozen=True)
class CalibrationOptions:
    method: str = "mse"
    group_size: int = 32  # channels per scale, as the export's default (--kv-group-size)
    percentile: float = 99.99
    max_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise KvedgeError(f"--method {self.method!r} is not allowed; allowed: {list(METHODS)}")
        if not 90.0 <= self.percentile <= 100.0:
            raise KvedgeError(f"--percentile {self.percentile!r} is out of range; allowed: 90..100")


def calibrate(model: Model, prompts: list[Prompt], options: CalibrationOptions) -> Scales:
    """Static scales and per-layer error statistics for `model` over `prompts`."""
    head_dim = model.manifest.geometry.head_dim
    if model.manifest.geometry.quantized or model.manifest.geometry.packed:
        raise KvedgeError(
            f"calibration reads float K/V: give the float32-cache export, not a "
            f"{model.manifest.geometry.dtype} one"
        )
    if head_dim % options.group_size:
        raise KvedgeError(f"--kv-group-size {options.group_size} does not divide head_dim {head_dim}")
    k, v, tokens = collect_kv(model, prompts, options.max_tokens)
    layers = k.shape[0]
    k_scale = np.stack(
        [
            scales_from_thresholds(thresholds(k[i], options.group_size, options.method, options.percentile))
            for i in range(layers)
        ]
    )
    v_scale = np.stack(
        [
            scales_from_thresholds(thresholds(v[i], options.group_size, options.method, options.percentile))
            for i in range(layers)
        ]
    )
    k_tensor = scales_from_thresholds(
        [tensor_threshold(k[i], options.method, options.percentile) for i in range(layers)]
    )
    v_tensor = scales_from_thresholds(
        [tensor_threshold(v[i], options.method, options.percentile) for i in range(layers)]
    )
    for name, array in (("k", k_scale), ("v", v_scale), ("k tensor", k_tensor), ("v tensor", v_tensor)):
        if not np.isfinite(array).all():
            raise KvedgeError(f"{name} scales contain NaN or inf; no scales written")
    errors: dict[str, list[float]] = {
        key: []
        for key in (
            "k_group_rel",
            "k_tensor_rel",
            "v_token_rel",
            "v_group_rel",
            "v_tensor_rel",
            "k_group_max",
            "v_token_max",
        )
    }
    g = options.group_size
    for i in range(layers):
        rel, mx = roundtrip_error(k[i], expand(k_scale[i], g)[None])
        errors["k_group_rel"].append(rel)
        errors["k_group_max"].append(mx)
        errors["k_tensor_rel"].append(roundtrip_error(k[i], k_tensor[i])[0])
        rel, mx = roundtrip_error(v[i], expand(dynamic_scales(v[i], g), g))
        errors["v_token_rel"].append(rel)
        errors["v_token_max"].append(mx)
        errors["v_group_rel"].append(roundtrip_error(v[i], expand(v_scale[i], g)[None])[0])
        errors["v_tensor_rel"].append(roundtrip_error(v[i], v_tensor[i])[0])
    manifest = ScalesManifest(
        method=options.method,
        group_size=g,
        model_fingerprint=model.manifest.source_fingerprint,
        geometry=model.manifest.geometry.artifact_key(holds_cache=False),
        calibration_hash=prompts_hash(prompts),
        calibration_prompts=len(prompts),
        calibration_tokens=tokens,
        npz_sha256="",  # set by Scales.save from the bytes written
        layer_errors={key: [round(x, 6) for x in values] for key, values in errors.items()},
    )
    return Scales(
        manifest=manifest, k_scale=k_scale, v_scale=v_scale, k_tensor_scale=k_tensor, v_tensor_scale=v_tensor
    )


def plot_errors(scales: Scales, path: Path) -> Path:
    """PNG of per-layer relative round-trip error for K and V under each scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    errors = scales.manifest.layer_errors
    fig, (ax_k, ax_v) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for key, label in (
        ("k_group_rel", f"per-group (g={scales.manifest.group_size})"),
        ("k_tensor_rel", "per-tensor"),
    ):
        ax_k.plot(errors[key], marker="o", label=label)
    for key, label in (
        ("v_token_rel", "per-token dynamic"),
        ("v_group_rel", "per-group static"),
        ("v_tensor_rel", "per-tensor"),
    ):
        ax_v.plot(errors[key], marker="o", label=label)
    for ax, title in ((ax_k, "K"), (ax_v, "V")):
        ax.set_title(f"{title}: INT8 round-trip error ({scales.manifest.method})")
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_k.set_ylabel("relative L2 error")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
