"""The bytes of a recipe's weights as `kvedge export` writes them in a given form (`ExportRecipe`:
every projection quantized or float, the head, the embedding table), and the float32 copy a
float32 graph makes of float16-stored weights at load.

A "module docstring" cited here is the package's (kvedge/planner/__init__.py), which documents
each term of the estimate.
"""

from __future__ import annotations

import numpy as np

from kvedge.configs import Architecture
from kvedge.contract import ExportRecipe, per_layer_dtype

FLOAT32 = 4  # the graph computes activations in float32
NPY_HEADER = 128  # numpy's .npy header of a 2-D table (format 1.0, padded to 64 bytes)


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
    """The bytes of an export of architecture `a` in weight form `form` (module docstring), Gemma
    4's per-layer table aside (`per_layer_bytes`: a file the runtime maps, not the graph's)."""
    params = a.param_count - a.per_layer_params
    if not form.quantized:
        return params * form.bits // 8
    h = a.hidden_size
    matmuls = layer_matmuls(a)
    # a tied table is the head's blocks (the runtime looks embeddings up there); an untied model's
    # input table is 8-bit codes with a scale and an offset per block, beside its quantized head
    # (`kvedge.export.export.write_embedding_table`)
    table = h * a.vocab_size
    tables = 1 if a.tie_word_embeddings else 2
    rest = params - sum(k * n for k, n in matmuls) - tables * table  # float
    quantized = sum(quantized_matmul_bytes(k, n, form.bits, form) for k, n in matmuls)
    real = 2 if form.half else FLOAT32
    head = quantized_matmul_bytes(h, a.vocab_size, form.lm_head_bits, form)
    embeddings = 0 if a.tie_word_embeddings else table + 2 * real * (h // form.block_size) * a.vocab_size
    return real * rest + quantized + head + embeddings


def per_layer_bytes(a: Architecture, form: ExportRecipe) -> int:
    """The bytes of Gemma 4's per-layer table file in form `form` (`contract.per_layer_dtype`,
    plus numpy's .npy header); 0 for models without one."""
    if not a.per_layer_params:
        return 0
    return a.per_layer_params * np.dtype(per_layer_dtype(form.weights)).itemsize + NPY_HEADER


def layer_matmuls(a: Architecture) -> list[tuple[int, int]]:
    """[K, N] of every projection of the layers, as the graph builder makes them (its `linear`
    calls): attention's fused QKV and O (Qwen3.5's output gate too; Q alone on Gemma 4's shared
    layers, each layer at its own head_dim), LFM2's convolution in [3 hidden] and out, Qwen3.5's
    Gated DeltaNet in (QKV, z, b, a fused) and out; every layer's fused gate/up and down at its
    width; Gemma 4's per-layer input gate and projection, and the model's projection to them."""
    h, per_layer, kv_layers = a.hidden_size, a.hidden_size_per_layer_input or 0, set(a.kv_layers)
    found: list[tuple[int, int]] = []
    for layer in range(a.num_layers):
        if layer in kv_layers or layer in a.shared_layers:
            q, kv = a.num_heads * a.layer_head_dim(layer), a.num_kv_heads * a.layer_head_dim(layer)
            found += [(h, q + (0 if layer in a.shared_layers else 2 * kv)), (q, h)]
            found += [(h, q)] if a.family == "qwen3_5_text" else []
        elif a.family == "lfm2":
            found += [(h, 3 * h), (h, h)]
        else:  # qwen3_5_text's Gated DeltaNet
            kd = a.linear_num_key_heads * a.linear_key_head_dim
            vd = a.linear_num_value_heads * a.linear_value_head_dim
            found += [(h, 2 * kd + 2 * vd + 2 * a.linear_num_value_heads), (vd, h)]
        width = a.layer_intermediate(layer)
        found += [(h, 2 * width), (width, h)] + ([(h, per_layer), (per_layer, h)] if per_layer else [])
    return found + ([(h, a.num_layers * per_layer)] if per_layer else [])


def recipe_note(a: Architecture, form: ExportRecipe) -> str:
    """What a recipe's weight bytes are: its parameters, the bits each costs on disk (codes,
    scales, offsets, kept channels and float tensors together) and the form (Gemma 4's per-layer
    table aside, on a line of its own)."""
    params = a.param_count - a.per_layer_params
    bits = 8 * recipe_weight_bytes(a, form) / params
    return f"{params:,} params at {bits:.2f} bits each, {form.describe_weights()}"


def widened_bytes(weights: int, precision: str, weights_dtype: str) -> int:
    """The float32 copy a float32 graph makes of float16-stored weights at load (its Casts of
    constants are folded), 2 x their bytes; a float16 graph computes with them as they are."""
    return 2 * weights if (precision, weights_dtype) == ("float32", "float16") else 0
