"""Build the KV-bound decoder graph in ONNX, op by op, from a Hugging Face state dict.

Why build by hand instead of tracing with `torch.onnx.export`: the op list is ours to choose
(only ops TensorRT's ONNX parser accepts at opset 17), tied embeddings are stored once, and the
KV binding below is exact rather than whatever a tracer makes of a cache class.

The contract (names come from `kvedge.contract.IONames`)::

    inputs  input_ids      [b, s]                     int64
            position_ids   [b, s]                     int64  (index into the RoPE tables)
            past_lengths   [b]                        int64  (valid slots of each row's cache)
            last_index     [b]                        int64  (only when logits="last")
            past K/V per layer [b, kv_heads, L, d]    L = max_len, fixed
    outputs logits         [b, 1, vocab] ("last") or [b, s, vocab] ("all")
            present K/V per layer [b, kv_heads, s, d] the new tokens only, K after RoPE

Attention, per layer, with g = heads / kv_heads query heads sharing each KV head::

    q4       = rope(q) * d**-0.5 reshaped to [b, kv_heads, g*s, d]   (scale folded into Wq)
    scores   = concat(q4 @ past_k^T, q4 @ new_k^T) + mask            [b, kv_heads, g*s, L+s]
    probs    = softmax(scores)
    out      = probs[..., :L] @ past_v + probs[..., L:] @ new_v

GQA is a reshape of Q, never a repeat of K/V, and the cache is only read: nothing of size
max_len is copied or concatenated. The mask is computed once per call from `past_lengths`
(slot j of row b is visible iff j < past_lengths[b]) plus a causal mask over the new tokens;
stale data beyond the valid length is masked out with -inf, so the runtime must keep buffers
finite (they are zero-initialised and only ever written with finite K/V).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvedge.contract import CacheGeometry, IONames
from kvedge.errors import KvedgeError

OPSET = 17
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class DecoderSpec:
    """The numbers the graph needs from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Any) -> DecoderSpec:
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def rope_tables(
    inv_freq: np.ndarray, attention_scaling: float, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_len, head_dim/2] for positions 0..max_len-1 (HF rotate_half layout)."""
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv_freq.astype(np.float64))
    cos = (np.cos(freqs) * attention_scaling).astype(np.float32)
    sin = (np.sin(freqs) * attention_scaling).astype(np.float32)
    return cos, sin


class _Builder:
    """Appends nodes and initializers; every op returns the name of its (first) output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int = 1, **attrs: Any):
        self._count += 1
        outs = [f"{name}" if outputs == 1 else f"{name}_{i}" for i in range(outputs)]
        node = helper.make_node(op_type, inputs, outs, name=f"{name}/{op_type}_{self._count}", **attrs)
        self.nodes.append(node)
        return outs[0] if outputs == 1 else outs

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name


def build_decoder_graph(
    spec: DecoderSpec,
    geometry: CacheGeometry,
    weights: dict[str, np.ndarray],
    cos: np.ndarray,
    sin: np.ndarray,
    names: IONames,
    logits: str = "last",
    progress: Callable[[int], None] | None = None,
) -> onnx.ModelProto:
    """The decoder as an ONNX model. `weights` uses Hugging Face state-dict names and layouts."""
    if logits not in ("last", "all"):
        raise KvedgeError(f"logits={logits!r} is not allowed; choose 'last' or 'all'")
    if geometry.dtype != "float32":
        raise KvedgeError(f"cache dtype {geometry.dtype!r} is not exported yet; allowed: 'float32'")
    g = _Builder()
    heads, kv_heads, d = spec.num_heads, geometry.num_kv_heads, geometry.head_dim
    groups = heads // kv_heads
    length = geometry.max_len
    dtype = geometry.np_dtype

    def w(name: str) -> np.ndarray:
        return weights[name].astype(np.float32)

    def linear(x: str, prefix: str, parts: list[str], out: str) -> str:
        """x @ concat(W_parts)^T + concat(b_parts): fused projections cost one MatMul."""
        mat = np.concatenate([w(f"{prefix}.{p}.weight") for p in parts], axis=0)
        y = g.op("MatMul", [x, g.const(f"{out}.weight", mat.T)], out)
        biases = [f"{prefix}.{p}.bias" for p in parts]
        if all(b in weights for b in biases):
            bias = np.concatenate([w(b) for b in biases])
            y = g.op("Add", [y, g.const(f"{out}.bias", bias)], f"{out}.biased")
        elif any(b in weights for b in biases):
            raise KvedgeError(f"{prefix}: some of {parts} have a bias and some do not")
        return y

    def rms_norm(x: str, weight: np.ndarray, name: str) -> str:
        # Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern onnxruntime fuses into one norm kernel.
        sq = g.op("Pow", [x, two], f"{name}.sq")
        mean = g.op("ReduceMean", [sq], f"{name}.mean", axes=[-1], keepdims=1)
        root = g.op("Sqrt", [g.op("Add", [mean, g.const(f"{name}.eps", eps)], f"{name}.var")], name + ".rms")
        normed = g.op("Div", [x, root], f"{name}.normed")
        return g.op("Mul", [normed, g.const(f"{name}.weight", weight)], name)

    def rope(x: str, name: str) -> str:
        """x [b, n, s, d] rotated by the positions' angles (HF rotate_half convention)."""
        x1, x2 = g.op("Split", [x, half_split], f"{name}.halves", outputs=2, axis=-1)
        r1 = g.op(
            "Sub",
            [g.op("Mul", [x1, cos4], f"{name}.x1c"), g.op("Mul", [x2, sin4], f"{name}.x2s")],
            f"{name}.r1",
        )
        r2 = g.op(
            "Add",
            [g.op("Mul", [x2, cos4], f"{name}.x2c"), g.op("Mul", [x1, sin4], f"{name}.x1s")],
            f"{name}.r2",
        )
        return g.op("Concat", [r1, r2], name, axis=-1)

    two = g.const("const.two", np.array(2.0, np.float32))
    eps = np.array(spec.rms_norm_eps, np.float32)
    half_split = g.const("const.rope_split", np.array([d // 2, d // 2], np.int64))
    zero_i = g.const("const.zero_i64", np.array([0], np.int64))
    one_i = g.const("const.one_i64", np.array([1], np.int64))
    two_i = g.const("const.two_i64", np.array([2], np.int64))

    # Per-call values shared by all layers: RoPE angles and the attention mask.
    pos_cos = g.op("Gather", [g.const("rope.cos", cos), names.position_ids], "rope.pos_cos", axis=0)
    pos_sin = g.op("Gather", [g.const("rope.sin", sin), names.position_ids], "rope.pos_sin", axis=0)
    cos4 = g.op("Unsqueeze", [pos_cos, one_i], "rope.cos4")  # [b, 1, s, d/2]
    sin4 = g.op("Unsqueeze", [pos_sin, one_i], "rope.sin4")  # [b, 1, s, d/2]

    batch_seq = g.op("Shape", [names.input_ids], "shape.bs")  # [2] = (b, s)
    b_dim = g.op("Slice", [batch_seq, zero_i, one_i], "shape.b")
    s_dim = g.op("Slice", [batch_seq, one_i, two_i], "shape.s")
    neg_inf = g.const("const.neg_inf", np.array(-np.inf, np.float32))
    zero_f = g.const("const.zero_f", np.array(0.0, np.float32))
    slots = g.const("mask.slots", np.arange(length, dtype=np.int64)[None, :])  # [1, L]
    lengths = g.op("Unsqueeze", [names.past_lengths, one_i], "mask.lengths")  # [b, 1]
    past_ok = g.op("Less", [slots, lengths], "mask.past_ok")  # [b, L]
    past_bias = g.op("Where", [past_ok, zero_f, neg_inf], "mask.past_bias")
    past_bias4 = g.op(
        "Unsqueeze", [past_bias, g.const("const.axes12", np.array([1, 2], np.int64))], "mask.past4"
    )
    scalar_s = g.op("Squeeze", [s_dim, zero_i], "shape.s_scalar")
    new_idx = g.op(
        "Range",
        [
            g.const("const.zero_scalar", np.array(0, np.int64)),
            scalar_s,
            g.const("const.one_scalar", np.array(1, np.int64)),
        ],
        "mask.new_idx",
    )
    rows = g.op("Unsqueeze", [new_idx, one_i], "mask.rows")  # [s, 1]
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [new_idx, zero_i], "mask.cols"), rows], "mask.causal")
    new_bias = g.op("Where", [causal, zero_f, neg_inf], "mask.new_bias")  # [s, s]
    const_1 = g.const("const.one_list", np.array([1], np.int64))
    past_shape = g.op(
        "Concat",
        [b_dim, const_1, s_dim, g.const("const.L", np.array([length], np.int64))],
        "mask.past_shape",
        axis=0,
    )
    new_shape = g.op("Concat", [b_dim, const_1, s_dim, s_dim], "mask.new_shape", axis=0)
    mask = g.op(
        "Concat",
        [
            g.op("Expand", [past_bias4, past_shape], "mask.past_full"),
            g.op("Expand", [new_bias, new_shape], "mask.new_full"),
        ],
        "mask.bs",
        axis=-1,
    )  # [b, 1, s, L+s]
    mask = g.op(
        "Tile", [mask, g.const("mask.tile", np.array([1, 1, groups, 1], np.int64))], "mask"
    )  # [b, 1, g*s, L+s]
    split_ls = g.op(
        "Concat", [g.const("const.L_list", np.array([length], np.int64)), s_dim], "attn.split_ls", axis=0
    )

    q_shape = g.const("shape.q", np.array([0, 0, heads, d], np.int64))
    kv_shape = g.const("shape.kv", np.array([0, 0, kv_heads, d], np.int64))
    grouped = g.const("shape.grouped", np.array([0, kv_heads, -1, d], np.int64))
    per_head = g.const("shape.per_head", np.array([0, heads, -1, d], np.int64))
    merged = g.const("shape.merged", np.array([0, 0, heads * d], np.int64))
    qkv_split = g.const("attn.qkv_split", np.array([heads * d, kv_heads * d, kv_heads * d], np.int64))
    mlp_split = g.const("mlp.split", np.array([spec.intermediate_size] * 2, np.int64))

    weights = dict(weights)
    scale = 1.0 / math.sqrt(d)
    for i in range(geometry.num_layers):  # fold the softmax scale into Wq (RoPE is linear)
        weights[f"model.layers.{i}.self_attn.q_proj.weight"] = (
            w(f"model.layers.{i}.self_attn.q_proj.weight") * scale
        )
        if f"model.layers.{i}.self_attn.q_proj.bias" in weights:
            weights[f"model.layers.{i}.self_attn.q_proj.bias"] = (
                w(f"model.layers.{i}.self_attn.q_proj.bias") * scale
            )

    embed = w("model.embed_tokens.weight")  # [vocab, hidden]
    embed_name = g.const("model.embed_tokens.weight", embed)
    hidden = g.op("Gather", [embed_name, names.input_ids], "model.embed", axis=0)  # [b, s, H]
    outputs: list[onnx.ValueInfoProto] = []
    for i in range(geometry.num_layers):
        p = f"model.layers.{i}"
        x = rms_norm(hidden, w(f"{p}.input_layernorm.weight"), f"{p}.input_layernorm")
        qkv = linear(x, f"{p}.self_attn", ["q_proj", "k_proj", "v_proj"], f"{p}.attn.qkv")
        q, k, v = g.op("Split", [qkv, qkv_split], f"{p}.attn.qkv_parts", outputs=3, axis=-1)
        q = g.op(
            "Transpose",
            [g.op("Reshape", [q, q_shape], f"{p}.attn.q5")],
            f"{p}.attn.q_bhsd",
            perm=[0, 2, 1, 3],
        )
        k = g.op(
            "Transpose",
            [g.op("Reshape", [k, kv_shape], f"{p}.attn.k4")],
            f"{p}.attn.k_bhsd",
            perm=[0, 2, 1, 3],
        )
        v = g.op(
            "Transpose",
            [g.op("Reshape", [v, kv_shape], f"{p}.attn.v4")],
            names.layer(names.present_value, i),
            perm=[0, 2, 1, 3],
        )
        q = g.op("Reshape", [rope(q, f"{p}.attn.q_rope"), grouped], f"{p}.attn.q_grouped")  # [b, kvh, g*s, d]
        k = rope(k, names.layer(names.present_key, i))  # [b, kvh, s, d]
        past_k, past_v = names.layer(names.past_key, i), names.layer(names.past_value, i)
        scores = g.op(
            "Concat",
            [
                g.op(
                    "MatMul",
                    [q, g.op("Transpose", [past_k], f"{p}.attn.past_kT", perm=[0, 1, 3, 2])],
                    f"{p}.attn.past_scores",
                ),
                g.op(
                    "MatMul",
                    [q, g.op("Transpose", [k], f"{p}.attn.new_kT", perm=[0, 1, 3, 2])],
                    f"{p}.attn.new_scores",
                ),
            ],
            f"{p}.attn.scores",
            axis=-1,
        )
        probs = g.op("Softmax", [g.op("Add", [scores, mask], f"{p}.attn.masked")], f"{p}.attn.probs", axis=-1)
        p_past, p_new = g.op("Split", [probs, split_ls], f"{p}.attn.probs_parts", outputs=2, axis=-1)
        attn = g.op(
            "Add",
            [
                g.op("MatMul", [p_past, past_v], f"{p}.attn.from_past"),
                g.op("MatMul", [p_new, v], f"{p}.attn.from_new"),
            ],
            f"{p}.attn.context",
        )  # [b, kvh, g*s, d]
        attn = g.op("Reshape", [attn, per_head], f"{p}.attn.per_head")  # [b, heads, s, d]
        attn = g.op(
            "Reshape",
            [g.op("Transpose", [attn], f"{p}.attn.bshd", perm=[0, 2, 1, 3]), merged],
            f"{p}.attn.merged",
        )
        hidden = g.op(
            "Add", [hidden, linear(attn, f"{p}.self_attn", ["o_proj"], f"{p}.attn.o")], f"{p}.attn.residual"
        )
        x = rms_norm(hidden, w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm")
        gate, up = g.op(
            "Split",
            [linear(x, f"{p}.mlp", ["gate_proj", "up_proj"], f"{p}.mlp.gate_up"), mlp_split],
            f"{p}.mlp.parts",
            outputs=2,
            axis=-1,
        )
        act = g.op(
            "Mul",
            [g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.mlp.sig")], f"{p}.mlp.silu"), up],
            f"{p}.mlp.act",
        )
        hidden = g.op(
            "Add", [hidden, linear(act, f"{p}.mlp", ["down_proj"], f"{p}.mlp.down")], f"{p}.mlp.residual"
        )
        for template in (names.present_key, names.present_value):
            outputs.append(
                helper.make_tensor_value_info(
                    names.layer(template, i), _onnx_dtype(dtype), ["batch", kv_heads, "seq", d]
                )
            )
        if progress:
            progress(1)

    if logits == "last":
        index = g.op("Unsqueeze", [names.last_index, one_i], "logits.index")  # [b, 1]
        hidden = g.op("GatherND", [hidden, index], "logits.last_hidden", batch_dims=1)  # [b, H]
    else:
        hidden = g.op(
            "Reshape",
            [hidden, g.const("shape.rows", np.array([-1, spec.hidden_size], np.int64))],
            "logits.rows",
        )
    hidden = rms_norm(hidden, w("model.norm.weight"), "model.norm")
    if spec.tie_word_embeddings or "lm_head.weight" not in weights:
        head = embed_name
    else:
        head = g.const("lm_head.weight", w("lm_head.weight"))
    scores = g.op("Gemm", [hidden, head], "logits.rows_vocab", transB=1)
    vocab = g.const("const.vocab", np.array([spec.vocab_size], np.int64))
    if logits == "last":
        out_shape = g.op("Concat", [b_dim, const_1, vocab], "shape.logits", axis=0)
    else:
        out_shape = g.op("Concat", [b_dim, s_dim, vocab], "shape.logits", axis=0)
    g.op("Reshape", [scores, out_shape], names.logits)

    inputs = [
        helper.make_tensor_value_info(names.input_ids, TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info(names.position_ids, TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info(names.past_lengths, TensorProto.INT64, ["batch"]),
    ]
    if logits == "last":
        inputs.append(helper.make_tensor_value_info(names.last_index, TensorProto.INT64, ["batch"]))
    for i in range(geometry.num_layers):
        for template in (names.past_key, names.past_value):
            inputs.append(
                helper.make_tensor_value_info(
                    names.layer(template, i), _onnx_dtype(dtype), ["batch", kv_heads, length, d]
                )
            )
    logits_shape = ["batch", 1 if logits == "last" else "seq", spec.vocab_size]
    outputs.insert(0, helper.make_tensor_value_info(names.logits, TensorProto.FLOAT, logits_shape))
    graph = helper.make_graph(g.nodes, "kvedge_decoder", inputs, outputs, g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kvedge")
    model.ir_version = 8  # what onnxruntime and TensorRT 8.6+ both read
    return model


def _onnx_dtype(dtype: np.dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
