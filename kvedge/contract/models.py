"""What an artifact can hold and a chat can say: the model families `kvedge export` builds a graph
for (Hugging Face `model_type` -> a name people know) and the roles a chat message may take.

The exporter refuses other families (`kvedge.export.source`), the recipe configs check their
`family` against the same list (`kvedge.configs`), and the tokenizer, the configs' warm prefixes
and the service check roles against `ROLES`: facts several layers share, so they live here.
"""

SUPPORTED_MODEL_TYPES = {
    "llama": "Llama family",
    "qwen2": "Qwen2/Qwen2.5",
    "mistral": "Mistral",
    "qwen3": "Qwen3 dense",
    "phi3": "Phi-3/Phi-3.5/Phi-4-mini",
    "smollm3": "SmolLM3",
    "gemma3_text": "Gemma 3 text (portable graph; local layers on a ring-buffer cache)",
    "lfm2": "LFM2 / LFM2.5 (portable graph; convolution layers' state kept per slot)",
    "qwen3_5_text": "Qwen3.5 dense text (portable graph; Gated DeltaNet layers' states kept per slot)",
    "gemma4_text": "Gemma 4 text (shared-KV layers store none; per-layer embeddings mapped)",
}

# Hybrid families: HF's `layer_types` values per family, the KV layer's first. "full_attention"
# layers hold KV; the other kind holds a fixed-size state per slot (`CacheGeometry.states`).
HYBRID_LAYER_TYPES = {
    "lfm2": ("full_attention", "conv"),
    "qwen3_5_text": ("full_attention", "linear_attention"),
}

# What a family's graph is not built for: (the choices, why, what to use instead). `kvedge
# export` refuses them by name (`family_refusal`), and the planner plans none of them.
FAMILY_REFUSED = {
    "gemma4_text": (
        (
            {"variant": "ort", "kv_dtype": "float16"},
            "its shared-KV layers read the cache in float32 ops",
            "use --kv-dtype float32 or int8, or --variant portable",
        ),
    ),
}

ROLES = ("system", "user", "assistant", "tool")


def family_refusal(family: str, **choices: str) -> str | None:
    """Why `kvedge export` builds no graph of `family` with `choices` (variant=, precision=,
    kv_dtype=), in the words the export refuses with, or None (`FAMILY_REFUSED`)."""
    for refused, why, instead in FAMILY_REFUSED.get(family, ()):
        if all(choices.get(choice) == value for choice, value in refused.items()):
            flags = " ".join(f"--{choice.replace('_', '-')} {value}" for choice, value in refused.items())
            name = SUPPORTED_MODEL_TYPES[family].split(" (")[0]
            return f"{flags} is not built for {name} yet ({why}); {instead}"
    return None
