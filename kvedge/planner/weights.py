"""The bytes of a recipe's weights as `kvedge export` writes them in a given form (`ExportRecipe`:
every projection quantized or float, the head, the embedding table), and the float32 copy a
float32 graph makes of float16-stored weights at load.

A "module docstring" cited here is the package's (kvedge/planner/__init__.py), which documents
each term of the estimate.
"""

from __future__ import annotations

from kvedge.configs import Architecture
from kvedge.contract import ExportRecipe

FLOAT32 = 4  # the graph computes activations in float32


# model.onnx bytes of the 16 nodes that split a float32 portable graph's quantized product input
# in two (`kvedge.export.graph.quant_matmul._product`): 313,736 over SmolLM2-135M's 121
SPLIT_GRAPH_BYTES = 2600


def quantized_matmul_bytes(k: int, n: int, bits: int, form: ExportRecipe) -> int:
    """Bytes `kvedge export` stores for one quantized w [K, N] (module docstring, `graph.py`'s
    `matmul_weight` and `_quant_matmul`)."""
    blocks, kept = k // form.block_size, form.kept_channels
    codes, real = k * n * bits // 8, 2 if form.half else FLOAT32  # a float16 graph's floats are float16
    total = codes + real * blocks * n + real * (blocks + kept) * n  # scales, second product
    total += 8 * kept  # the kept channels' indices (kvedge.SideInputs', or a Gather's)
    if form.variant == "portable" and kept:  # side inputs from standard ops: the 0/1 mask [K]
        total += real * k
    if form.variant == "portable" and not form.half:  # the nodes splitting its input (`_product`)
        total += SPLIT_GRAPH_BYTES
    if form.two_forms and n % 64 == 0:  # decode form: codes, float16 scale + minimum, float16 rows
        total += codes + 2 * 2 * blocks * n + 2 * kept * n
    return total


def recipe_weight_bytes(a: Architecture, form: ExportRecipe) -> int:
    """The bytes of an export of architecture `a` in weight form `form` (module docstring)."""
    if not form.quantized:
        return a.param_count * form.bits // 8
    h = a.hidden_size
    matmuls = layer_matmuls(a)
    # a tied table is the head's blocks (the runtime looks embeddings up there); an untied model's
    # input table is 8-bit codes with a scale and an offset per block, beside its quantized head
    # (`kvedge.export.export.write_embedding_table`)
    table = h * a.vocab_size
    tables = 1 if a.tie_word_embeddings else 2
    rest = a.param_count - sum(k * n for k, n in matmuls) - tables * table  # float
    quantized = sum(quantized_matmul_bytes(k, n, form.bits, form) for k, n in matmuls)
    real = 2 if form.half else FLOAT32
    head = quantized_matmul_bytes(h, a.vocab_size, form.lm_head_bits, form)
    embeddings = 0 if a.tie_word_embeddings else table + 2 * real * (h // form.block_size) * a.vocab_size
    return real * rest + quantized + head + embeddings


def layer_matmuls(a: Architecture) -> list[tuple[int, int]]:
    """[K, N] of every projection of the layers, as the graph builder makes them (its `linear`
    calls): attention's fused QKV and O (Qwen3.5's output gate too), LFM2's convolution in
    [3 hidden] and out, Qwen3.5's Gated DeltaNet in (QKV, z, b, a fused) and out; every layer's fused
    gate/up and down."""
    q, kv, h, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
    attention = [(h, q + 2 * kv), (q, h)] + ([(h, q)] if a.family == "qwen3_5_text" else [])
    if a.family == "lfm2":
        mixer = [(h, 3 * h), (h, h)]
    elif a.family == "qwen3_5_text":
        kd, vd = (
            a.linear_num_key_heads * a.linear_key_head_dim,
            a.linear_num_value_heads * a.linear_value_head_dim,
        )
        mixer = [(h, 2 * kd + 2 * vd + 2 * a.linear_num_value_heads), (vd, h)]
    else:
        mixer = attention
    kv_layers = set(a.kv_layers)
    return [m for layer in range(a.num_layers) for m in (attention if layer in kv_layers else mixer)] + [
        (h, 2 * i),
        (i, h),
    ] * a.num_layers


def recipe_note(a: Architecture, form: ExportRecipe) -> str:
    """What a recipe's weight bytes are: its parameters, the bits each costs on disk (codes,
    scales, offsets, kept channels and float tensors together) and the form."""
    bits = 8 * recipe_weight_bytes(a, form) / a.param_count
    return f"{a.param_count:,} params at {bits:.2f} bits each, {form.describe_weights()}"


def widened_bytes(weights: int, precision: str, weights_dtype: str) -> int:
    """The float32 copy a float32 graph makes of float16-stored weights at load (its Casts of
    constants are folded), 2 x their bytes; a float16 graph computes with them as they are."""
    return 2 * weights if (precision, weights_dtype) == ("float32", "float16") else 0
