"""The decoder, block by block, on one `Builder`: embeddings, layers (norms, QKV, the variant's
attention, the gated MLP) and the logits; `build_decoder_graph` is the entry point.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from kvedge.contract import (
    HEAD_TABLE,
    PREFILL_CHUNK,
    QUANT_MATMUL_OP,
    SIDE_INPUTS_OP,
    CacheGeometry,
    ExportRecipe,
    GraphInterface,
    IONames,
    check_kv_dtype,
    kvedge_ops,
)
from kvedge.errors import KvedgeError
from kvedge.export.graph.builder import Builder
from kvedge.export.graph.external import ExternalData
from kvedge.export.graph.forms import onnx_model
from kvedge.export.graph.inplace import GroupQueryAttention, Int4CacheAttention, Int8CacheAttention
from kvedge.export.graph.norms import Norms
from kvedge.export.graph.options import HALF_KV_DTYPES, DecoderSpec, check_gemma4, check_ring, graph_opset
from kvedge.export.graph.portable import PortableAttention, RingSpec
from kvedge.export.graph.quant_matmul import block_weight, matmul_weight
from kvedge.export.graph.weights import LayerWeights, Weight, llama_name, tied_head
from kvedge.export.quantize import QuantizedWeight, concat_columns

log = logging.getLogger(__name__)


def build_decoder_graph(
    spec: DecoderSpec,
    geometry: CacheGeometry,
    weights: Mapping[str, Weight],
    cos: np.ndarray,
    sin: np.ndarray,
    names: IONames,
    options: ExportRecipe,
    progress: Callable[[int], None] | None = None,
    outliers: dict[str, np.ndarray] | None = None,
    local_tables: tuple[np.ndarray, np.ndarray] | None = None,
    kept: dict[str, QuantizedWeight] | None = None,
    sink: ExternalData | None = None,
) -> onnx.ModelProto:
    """The decoder as an ONNX model. `weights` uses Hugging Face state-dict names and layouts;
    `outliers` ({Linear name: input channels}, `quantize.input_outliers`) are kept float32 in
    quantized matmuls; `local_tables` (cos, sin [max_len, d/2]) rotate the sliding-window layers
    (`spec.local_layers`: Gemma 3's, their own RoPE base), `cos`/`sin` every other layer; `kept`
    (HF name: blocks [K, N], `weights.SourceBlocks.kept`) are stored as they are, not quantized;
    `sink` (the data file, `ExternalData`) takes the large initializers as they are made."""
    check_kv_dtype(geometry.dtype, options.variant, options.precision)
    check_ring(geometry, options.variant)
    check_gemma4(spec, options)
    if spec.local_layers and local_tables is None:
        raise KvedgeError("sliding-window layers need their RoPE tables (local_tables)")
    stored_local = tuple(i for i in spec.local_layers if i not in geometry.shared_layers)
    ring_model_layers = tuple(
        geometry.kv_layers[k] if geometry.kv_layers else k for k in geometry.ring_layers
    )
    if spec.local_layers and ring_model_layers not in ((), stored_local):
        raise KvedgeError(
            f"ring layers {list(ring_model_layers)} are not the model's sliding-window layers "
            f"{list(stored_local)}"
        )
    prepared = LayerWeights(spec, geometry, weights)  # one layer's arrays at a time
    kept_blocks = LayerWeights(spec, geometry, kept or {})  # read a layer at a time, as `prepared`
    # Graphs with kvedge.QuantMatMul hold two forms of the decoder (`onnx_model`): prefill's
    # matmuls stay onnxruntime's MatMulNBits (its many-row kernel), a decode step's and a
    # verify's (up to VERIFY_TOKENS tokens per row, `forms.two_forms`) are the op.
    forms = (
        (False, True)
        if QUANT_MATMUL_OP in kvedge_ops(options.variant, geometry.dtype, options.weights, options.decode)
        else (False,)
    )
    builders = []
    for decode_form in forms:
        decoder = Decoder(
            spec,
            geometry,
            prepared,
            cos,
            sin,
            names,
            options,
            {llama_name(name): channels for name, channels in (outliers or {}).items()},
            local_tables,
            decode_form,
            kept_blocks,
            sink,
        )
        hidden, delta = decoder.embed(), None  # delta: the last sublayer's output, added by the next norm
        for i in range(spec.num_layers or geometry.num_layers):
            hidden, delta = decoder.layer(i, hidden, delta)
            if progress:
                progress(1 / len(forms))
        if options.quantized:  # minutes at a large vocabulary, after the layers' bar has filled
            form = ("decode" if decode_form else "prefill") if len(forms) > 1 else "the graph"
            log.info("%s: quantizing the LM head [%d x %d]", form, spec.vocab_size, spec.hidden_size)
        decoder.logits(hidden, delta)
        builders.append(decoder.g)
    embeds = ("float16" if options.half else "float32") if runtime_embeddings(options) else ""
    per_layer = spec.gemma4.per_layer * spec.num_layers if spec.gemma4 else 0
    interface = GraphInterface(
        names, geometry, options.variant, options.logits, spec.vocab_size, spec.hidden_size, embeds, per_layer
    )
    return onnx_model(builders, interface, options)


def runtime_embeddings(options: ExportRecipe) -> bool:
    """The graph takes inputs_embeds, which the runtime looks up (`kvedge.contract.EmbeddingTable`:
    the quantized tied LM head's blocks, or an untied model's table quantized to 8 bits beside the
    graph), instead of gathering rows of a float table: a quantized graph."""
    return options.quantized


# factors of the Gated DeltaNet's triangular inverse (`Decoder.gated_delta_rule`): exact for calls
# of up to 2**DELTA_FACTORS tokens per row, PREFILL_CHUNK
DELTA_FACTORS = max(1, math.ceil(math.log2(PREFILL_CHUNK)))


@dataclass(frozen=True)
class CallPositions:
    """Masks over the call's positions, shared by its Gated DeltaNet layers."""

    real: str  # [b, s, 1] float: 1 at each row's real tokens (t < input_lengths), 0 at padding
    causal: str  # [s, s] bool: j <= i
    strict: str  # [s, s] bool: j < i


class Decoder:
    """The decoder's blocks as ops on one `Builder`: tensors shared by all layers are made at
    construction, then `embed`, `layer` (once per layer) and `logits` add the rest in order."""

    def __init__(
        self,
        spec: DecoderSpec,
        geometry: CacheGeometry,
        weights: Mapping[str, Weight],
        cos: np.ndarray,
        sin: np.ndarray,
        names: IONames,
        options: ExportRecipe,
        outliers: dict[str, np.ndarray],
        local_tables: tuple[np.ndarray, np.ndarray] | None = None,
        decode_form: bool = False,
        kept: dict[str, QuantizedWeight] | None = None,
        sink: ExternalData | None = None,
    ) -> None:
        self.spec, self.weights, self.names, self.options = spec, weights, names, options
        self.geometry = geometry
        self._positions: CallPositions | None = None
        self.outliers = outliers  # {Linear name: input channels kept float32 when quantized}
        self.kept = kept or {}  # {HF name: the source's blocks [K, N], stored as they are}
        self.portable = options.variant == "portable"
        ops = kvedge_ops(options.variant, geometry.dtype, options.weights)
        self.g = g = Builder(
            graph_opset(options), SIDE_INPUTS_OP in ops, decode_form, options.half, self.portable, sink
        )
        # a float16 graph over the INT8 cache runs attention in float32, as a float32 graph does:
        # its codec's products of a query with int8 codes before scaling can pass 65504
        self.wide_attention = options.half and geometry.quantized
        self.norms = Norms(g, spec.rms_norm_eps, fused=not self.portable)
        batch_seq = g.op("Shape", [names.input_ids], "shape.bs")  # [2] = (b, s)
        self.b_dim = g.op("Slice", [batch_seq, g.ints(0), g.ints(1)], "shape.b")  # [1]
        self.s_dim = g.op("Slice", [batch_seq, g.ints(1), g.ints(2)], "shape.s")  # [1]
        self.attention = self._attention(geometry, cos, sin, local_tables)
        if spec.activation == "gelu_pytorch_tanh":
            consts = {"cubic": 0.044715, "root": math.sqrt(2.0 / math.pi), "half": 0.5, "one": 1.0}
            self.gelu_consts = {k: g.fconst(f"gelu.{k}", np.array(v)) for k, v in consts.items()}
        self.per_layer: str | None = None  # [b, s, layers, P]: Gemma 4's per-layer inputs (`embed`)

    def _attention(self, geometry: CacheGeometry, cos: np.ndarray, sin: np.ndarray, local_tables=None):
        """The variant's attention (package docstring), sharing the RoPE tables [L, d/2] (float16
        over a float16 cache: attention computes in the cache's float type); the sliding-window
        layers read a ring (portable) or attend through a local window over a full length cache
        (ort), rotated with `local_tables`."""
        g = self.g
        half = geometry.dtype in HALF_KV_DTYPES
        table_dtype = np.float16 if half else np.float32
        ring, local = None, {}
        if self.spec.local_layers:
            local = dict(
                local_cos=g.const("rope.local_cos", local_tables[0].astype(table_dtype)),
                local_sin=g.const("rope.local_sin", local_tables[1].astype(table_dtype)),
                window=self.spec.window,
            )
        if geometry.ring_layers and self.portable:  # ort: rings of max_len, never wrapping (`check_ring`)
            ring = RingSpec(
                geometry.ring_len, geometry.window, local["local_cos"], local["local_sin"], geometry.ring_dim
            )
        tables = dict(
            cos_table=g.const("rope.cos", cos.astype(table_dtype)),
            sin_table=g.const("rope.sin", sin.astype(table_dtype)),
        )
        ctx = dict(
            g=g,
            heads=self.spec.num_heads,
            kv_heads=geometry.num_kv_heads,
            d=geometry.head_dim,
            length=geometry.max_len,
            names=self.names,
            s_dim=self.s_dim,
        )
        if self.portable:
            return PortableAttention(
                **ctx, **tables, b_dim=self.b_dim, kv_group_size=geometry.group_size, ring=ring, half=half
            )
        if local:  # Gemma 4's sliding layers: their own head_dim
            local["local_d"] = geometry.ring_dim
        if geometry.packed:
            return Int4CacheAttention(**ctx, **tables, geometry=geometry)
        if geometry.quantized:
            return Int8CacheAttention(**ctx, **tables, **local, group_size=geometry.group_size)
        return GroupQueryAttention(**ctx, **tables, **local, half=half)

    def w(self, name: str) -> np.ndarray:
        return self.weights[name].astype(np.float32, copy=False)

    def linear(self, x: str, prefix: str, parts: list[str], out: str) -> str:
        """x @ concat(W_parts)^T + concat(b_parts): fused projections cost one MatMul. The only
        place layer weights enter the graph (float32 or quantized, `quant_matmul.matmul_weight`)."""
        g, options = self.g, self.options
        mats = [self.w(f"{prefix}.{p}.weight") for p in parts]  # [N_part, K] each
        mat = np.concatenate(mats, axis=0)
        if g.half and not options.quantized:  # [N, K] behind a Transpose: TensorRT keeps one copy
            y = g.op("MatMul", [x, g.transposed_weight(f"{out}.weight", mat)], out)
        elif options.weights == "float16":
            weight = g.float_weight(f"{out}.weight", np.ascontiguousarray(mat.T), stored_half=True)
            y = g.op("MatMul", [x, weight], out)
        else:
            keep = self.outliers.get(f"{prefix}.{parts[0]}")  # fused parts share their input
            blocks = self.kept_blocks([f"{prefix}.{p}.weight" for p in parts], mats)
            y = matmul_weight(
                g, x, np.ascontiguousarray(mat.T), out, options.bits, options.block_size, keep, blocks=blocks
            )
        biases = [f"{prefix}.{p}.bias" for p in parts]
        if all(b in self.weights for b in biases):
            bias = np.concatenate([self.w(b) for b in biases])
            y = g.op("Add", [y, g.fconst(f"{out}.bias", bias)], f"{out}.biased")
        elif any(b in self.weights for b in biases):
            raise KvedgeError(f"{prefix}: some of {parts} have a bias and some do not")
        return y

    def kept_blocks(self, names: list[str], mats: list[np.ndarray]) -> QuantizedWeight | None:
        """The blocks of fused parts `names` (float weights `mats` [N_part, K]) side by side where
        any part keeps the source's: those as they are, the others quantized here (blocks run
        along K, so each part's columns keep their own); None where no part does."""
        kept = [self.kept.get(name) for name in names]
        if all(blocks is None for blocks in kept):
            return None
        bits, block_size = self.options.bits, self.options.block_size

        def part(m: np.ndarray, blocks: QuantizedWeight | None) -> QuantizedWeight:
            return (
                block_weight(self.g, np.ascontiguousarray(m.T), bits, block_size)
                if blocks is None
                else blocks
            )

        return concat_columns([part(m, blocks) for m, blocks in zip(mats, kept, strict=True)])

    def embed(self) -> str:
        """Token embeddings [b, s, H]: rows of the table gathered from input_ids, or the
        inputs_embeds the runtime looks up in a quantized graph (`runtime_embeddings`)."""
        if runtime_embeddings(self.options):
            rows = self.names.inputs_embeds
        else:
            self.embed_name = self.g.float_weight(
                "model.embed_tokens.weight",
                self.w("model.embed_tokens.weight"),  # [vocab, hidden]
                stored_half=self.options.weights == "float16",
            )
            rows = self.g.op("Gather", [self.embed_name, self.names.input_ids], "model.embed", axis=0)
        if self.spec.embed_scale == 1.0:
            return rows
        scale = self.g.fconst("model.embed_scale", np.array(self.spec.embed_scale, np.float32))
        embeds = self.g.op("Mul", [rows, scale], "model.embed_scaled")
        if self.spec.gemma4 and self.spec.gemma4.per_layer:
            self.per_layer = self.per_layer_inputs(embeds)
        return embeds

    def per_layer_inputs(self, embeds: str) -> str:
        """Gemma 4's per-layer inputs [b, s, layers, P] (HF's project_per_layer_inputs): the
        runtime's rows of the per-layer table (`names.per_layer_inputs` [b, s, layers P], already
        times sqrt(P)) plus RMSNorm(embeds W^T hidden**-0.5) per layer, times 2**-0.5.

        The rows enter every graph float32 and a float16 graph narrows them with one Cast: the
        table beside a float16 graph is stored float16 (`per_layer_dtype`), so the narrowing is
        exact, and the interface, the runtime's lookup and the TensorRT bindings stay one for all
        precisions. Feeding float16 would save one Cast and half of a few kilobytes per token."""
        g, spec = self.g, self.spec
        layers, width = spec.num_layers, spec.gemma4.per_layer
        p = "model.per_layer_model_projection"
        proj = self.linear(embeds, "model", ["per_layer_model_projection"], f"{p}.mm")  # [b, s, L P]
        proj = g.op("Mul", [proj, g.fconst(f"{p}.scale", np.array(spec.hidden_size**-0.5))], f"{p}.scaled")
        proj = g.op("Reshape", [proj, g.ints(0, 0, layers, width)], f"{p}.per_layer")
        normed = self.norms.rms_norm(
            proj, self.w("model.per_layer_projection_norm.weight"), "model.per_layer_projection_norm"
        )
        rows = g.narrow(self.names.per_layer_inputs, "model.per_layer_rows16")  # [b, s, layers P]
        table = g.op("Reshape", [rows, g.ints(0, 0, layers, width)], "model.per_layer_rows")
        both = g.op("Add", [normed, table], "model.per_layer_sum")
        return g.op("Mul", [both, g.fconst("model.per_layer_scale", np.array(2.0**-0.5))], "model.per_layer")

    def layer(self, i: int, hidden: str, delta: str | None) -> tuple[str, str]:
        """Decoder layer i: attention and MLP blocks. Returns (residual stream, MLP output)."""
        p = f"model.layers.{i}"
        x, hidden = self.norms.residual_norm(
            hidden, delta, self.w(f"{p}.input_layernorm.weight"), f"{p}.input_layernorm"
        )
        if i in self.spec.conv_layers or (self.spec.delta and i in self.spec.delta.layers):
            delta = self.short_conv(i, x) if i in self.spec.conv_layers else self.delta_net(i, x)
            x, hidden = self.norms.residual_norm(
                hidden, delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm"
            )
            return hidden, self.mlp(x, f"{p}.mlp")
        kv = self.geometry.kv_index(i)  # the index of its cache tensors' names
        shared = i in self.geometry.shared_layers  # Gemma 4: reads layer kv's K and V, has none
        parts = ["q_proj"] if shared else ["q_proj", "k_proj", "v_proj"]
        qkv = self.linear(x, f"{p}.self_attn", parts, f"{p}.attn.qkv")  # [b, s, (h+2kvh)d], or Q only
        if self.spec.qk_norm:
            qkv = self.qk_norm(qkv, i, f"{p}.self_attn", parts)
        if self.wide_attention:
            qkv = self.g.widen(qkv, f"{p}.attn.qkv32")
        local = i in self.spec.local_layers
        if shared:
            attn = self.attention.shared(kv, i, qkv, local=local)
        elif local:
            attn = self.attention.layer(kv, qkv, local=True)  # [b, s, heads*d]
        else:
            attn = self.attention.layer(kv, qkv, rotate=i not in self.spec.unrotated_layers)
        if self.wide_attention:
            attn = self.g.narrow(attn, f"{p}.attn.merged16")
        if self.spec.attention_gate:  # Qwen3.5: attn * sigmoid(gate(x)), per head and channel
            gate = self.linear(x, f"{p}.self_attn", ["attn_gate"], f"{p}.attn.gate")
            attn = self.g.op(
                "Mul", [attn, self.g.op("Sigmoid", [gate], f"{p}.attn.gate_sig")], f"{p}.attn.gated"
            )
        delta = self.linear(attn, f"{p}.self_attn", ["o_proj"], f"{p}.attn.o")
        if self.spec.gemma_norms:  # each sublayer's output normed before its residual add
            delta = self.norms.rms_norm(
                delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attn_norm"
            )
            x, hidden = self.norms.residual_norm(
                hidden,
                delta,
                self.w(f"{p}.pre_feedforward_layernorm.weight"),
                f"{p}.pre_feedforward_layernorm",
            )
            out = self.norms.rms_norm(
                self.mlp(x, f"{p}.mlp"),
                self.w(f"{p}.post_feedforward_layernorm.weight"),
                f"{p}.post_feedforward_layernorm",
            )
            if self.spec.gemma4:
                return self.gemma4_tail(i, hidden, out), None
            return hidden, out
        x, hidden = self.norms.residual_norm(
            hidden, delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm"
        )
        return hidden, self.mlp(x, f"{p}.mlp")

    def gemma4_tail(self, i: int, hidden: str, delta: str) -> str:
        """What a Gemma 4 layer adds after its MLP: the residual stream h = hidden + delta, then
        h + RMSNorm(W_proj (gelu(W_gate h) * per_layer_input_i)) where it has per-layer inputs,
        then times the layer's scalar (HF's Gemma4TextDecoderLayer)."""
        g, p = self.g, f"model.layers.{i}"
        h = g.op("Add", [hidden, delta], f"{p}.residual_mlp")
        if self.per_layer is not None:
            row = g.op(
                "Squeeze",
                [g.op("Gather", [self.per_layer, g.ints(i)], f"{p}.ple_row", axis=2), g.ints(2)],
                f"{p}.ple",
            )  # [b, s, P]
            gate = self.gelu_tanh(self.linear(h, p, ["per_layer_input_gate"], f"{p}.ple_gate"), f"{p}.ple")
            mixed = g.op("Mul", [gate, row], f"{p}.ple_mixed")  # [b, s, P]
            out = self.linear(mixed, p, ["per_layer_projection"], f"{p}.ple_proj")
            out = self.norms.rms_norm(out, self.w(f"{p}.post_per_layer_input_norm.weight"), f"{p}.ple_norm")
            h = g.op("Add", [h, out], f"{p}.residual_ple")
        scalar = self.w(f"{p}.layer_scalar").reshape(())
        return g.op("Mul", [h, g.fconst(f"{p}.layer_scalar", scalar)], f"{p}.scaled")

    def short_conv(self, i: int, x: str) -> str:
        """LFM2's gated short convolution of layer i over x [b, s, H] (transformers' Lfm2ShortConv):
        B, C, h = in_proj(x); u = B * h; y = C * conv(u); out_proj(y), `causal_conv` over u."""
        g, p, h = self.g, f"model.layers.{i}", self.spec.hidden_size
        bcx = self.linear(x, f"{p}.conv", ["in_proj"], f"{p}.conv.in")  # [b, s, 3H]
        b, c, u = g.op("Split", [bcx, g.ints(h, h, h)], f"{p}.conv.parts", outputs=3, axis=-1)
        u = g.op("Mul", [b, u], f"{p}.conv.bx")  # [b, s, H]
        out = self.causal_conv(i, u, f"{p}.conv.conv", f"{p}.conv")
        y = g.op("Mul", [c, out], f"{p}.conv.gated")  # [b, s, H]
        return self.linear(y, f"{p}.conv", ["out_proj"], f"{p}.conv.out")

    def causal_conv(self, i: int, u: str, weights: str, name: str) -> str:
        """Layer i's causal depthwise convolution over u [b, s, C] with `weights`.weight [C, 1, k]
        (and its bias where stored): out[t] = sum_j w[:, j] * u[t + j - (k - 1)], the positions
        before the call's first token read from the slot's "conv" state, its last k - 1 inputs
        [b, k - 1, C]. The new state is the k - 1 inputs ending at each row's last real token
        (input_lengths: a right-padded row's padding never enters it; a row of none keeps its
        state)."""
        g, names = self.g, self.names
        w = self.w(f"{weights}.weight")[:, 0, :]  # [C, k]
        k = w.shape[1]
        past = names.state(names.past_state, "conv", i)
        run = g.op("Concat", [past, u], f"{name}.run", axis=1)  # [b, k - 1 + s, C]
        out = None
        for j in range(k):
            end = g.op("Add", [self.s_dim, g.ints(j)], f"{name}.end{j}")
            tap = g.op("Slice", [run, g.ints(j), end, g.ints(1)], f"{name}.tap{j}")  # [b, s, C]
            term = g.op("Mul", [tap, g.fconst(f"{name}.w{j}", np.ascontiguousarray(w[:, j]))], f"{name}.t{j}")
            out = term if out is None else g.op("Add", [out, term], f"{name}.sum{j}")
        if f"{weights}.bias" in self.weights:
            out = g.op("Add", [out, g.fconst(f"{name}.bias", self.w(f"{weights}.bias"))], f"{name}.biased")
        # the new state: run[r, n_r : n_r + k - 1] for each row's n_r real tokens
        offsets = g.const(f"{name}.offsets", np.arange(k - 1, dtype=np.int64)[None, :])  # [1, k-1]
        starts = g.op("Unsqueeze", [names.input_lengths, g.ints(1)], f"{name}.n")  # [b, 1]
        index = g.op("Add", [starts, offsets], f"{name}.kept")  # [b, k - 1]
        index = g.op("Unsqueeze", [index, g.ints(2)], f"{name}.kept3")  # [b, k - 1, 1]
        g.op("GatherND", [run, index], names.state(names.present_state, "conv", i), batch_dims=1)
        return out

    def delta_net(self, i: int, x: str) -> str:
        """Qwen3.5's Gated DeltaNet layer i over x [b, s, H] (transformers' Qwen3_5GatedDeltaNet):
        one MatMul makes qkv, z, b, a; qkv goes through `causal_conv` and SiLU, then Q and K are
        L2-normed (Q times k_dim**-0.5), beta = sigmoid(b), the log decay g = -exp(A_log) *
        softplus(a + dt_bias), and `gated_delta_rule` runs the call's tokens against the slot's
        recurrent state; the output is RMS-normed per value head, gated by silu(z), projected."""
        g, p = self.g, f"model.layers.{i}.linear_attn"
        name = f"model.layers.{i}.dn"
        proj = self.linear(x, p, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], f"{name}.in")
        proj = g.widen(proj, f"{name}.in32")  # a float16 graph: the layer between is a float32 island
        with g.float32():
            gated = self._delta_core(i, proj, name)
        return self.linear(g.narrow(gated, f"{name}.gated16"), p, ["out_proj"], f"{name}.out")

    def _delta_core(self, i: int, proj: str, name: str) -> str:
        """`delta_net` between its projections, in float32: proj [b, s, qkv + z + b + a] -> the
        gated output [b, s, v_heads v_dim]."""
        g, spec, p = self.g, self.spec.delta, f"model.layers.{i}.linear_attn"
        c, vd, nv = spec.conv_channels, spec.v_heads * spec.v_dim, spec.v_heads
        qkv, z, b, a = g.op("Split", [proj, g.ints(c, vd, nv, nv)], f"{name}.parts", outputs=4, axis=-1)
        conv = self.causal_conv(i, qkv, f"{p}.conv1d", f"{name}.conv")
        conv = g.op("Mul", [conv, g.op("Sigmoid", [conv], f"{name}.conv_sig")], f"{name}.conv_silu")
        kd = spec.k_heads * spec.k_dim
        q, k, v = g.op("Split", [conv, g.ints(kd, kd, vd)], f"{name}.qkv", outputs=3, axis=-1)
        q = self._delta_heads(q, spec.k_dim**-0.5, f"{name}.q")  # [b, nv, s, dk]
        k = self._delta_heads(k, 1.0, f"{name}.k")
        v = g.op(
            "Transpose",
            [g.op("Reshape", [v, g.ints(0, 0, nv, spec.v_dim)], f"{name}.v4")],
            f"{name}.v_heads",
            perm=[0, 2, 1, 3],
        )  # [b, nv, s, dv]
        # padding (positions past a row's input_lengths) neither decays nor writes the state
        real = self.positions().real  # [b, s, 1] float: 1 at each row's real tokens
        beta = g.op("Mul", [g.op("Sigmoid", [b], f"{name}.beta0"), real], f"{name}.beta")  # [b, s, nv]
        a_log = self.w(f"{p}.A_log").astype(np.float32)
        rate = g.op(
            "Softplus",
            [g.op("Add", [a, g.fconst(f"{name}.dt_bias", self.w(f"{p}.dt_bias"))], f"{name}.a_dt")],
            f"{name}.softplus",
        )
        decay = g.op("Mul", [rate, g.fconst(f"{name}.neg_a", -np.exp(a_log))], f"{name}.g0")
        decay = g.op("Mul", [decay, real], f"{name}.g")  # [b, s, nv]
        beta, decay = (
            g.op("Transpose", [t], f"{name}.{n}_heads", perm=[0, 2, 1])
            for t, n in ((beta, "beta"), (decay, "g"))
        )  # [b, nv, s]
        out = self.gated_delta_rule(i, q, k, v, beta, decay, name)  # [b, nv, s, dv]
        out = g.op("Transpose", [out], f"{name}.out_bshd", perm=[0, 2, 1, 3])  # [b, s, nv, dv]
        normed = self.norms.rms_norm(out, self.w(f"{p}.norm.weight"), f"{name}.norm")
        z = g.op("Reshape", [z, g.ints(0, 0, nv, spec.v_dim)], f"{name}.z4")
        gate = g.op("Mul", [z, g.op("Sigmoid", [z], f"{name}.z_sig")], f"{name}.z_silu")
        return g.op(
            "Reshape", [g.op("Mul", [normed, gate], f"{name}.gated4"), g.ints(0, 0, vd)], f"{name}.gated"
        )

    def _delta_heads(self, x: str, scale: float, name: str) -> str:
        """Q or K [b, s, k_heads k_dim] L2-normed per head (eps 1e-6 inside the root, as
        transformers' l2norm) times `scale`, each head repeated for the value heads it serves:
        [b, v_heads, s, k_dim]."""
        g, spec = self.g, self.spec.delta
        x = g.op("Reshape", [x, g.ints(0, 0, spec.k_heads, spec.k_dim)], f"{name}4")
        sq = g.op("ReduceSum", [g.op("Mul", [x, x], f"{name}.sq"), g.ints(-1)], f"{name}.sumsq", keepdims=1)
        root = g.op(
            "Sqrt",
            [g.op("Add", [sq, g.fconst(f"{name}.eps", np.array(1e-6))], f"{name}.var")],
            f"{name}.norm",
        )
        x = g.op("Div", [x, root], f"{name}.unit")
        if scale != 1.0:
            x = g.op("Mul", [x, g.fconst(f"{name}.scale", np.array(scale))], f"{name}.scaled")
        r = spec.v_heads // spec.k_heads
        if r > 1:  # transformers' repeat_interleave: value head j reads key head j // r
            x = g.op("Unsqueeze", [x, g.ints(3)], f"{name}.one")  # [b, s, nk, 1, dk]
            x = g.op("Tile", [x, g.ints(1, 1, 1, r, 1)], f"{name}.tiled")
            x = g.op("Reshape", [x, g.ints(0, 0, spec.v_heads, spec.k_dim)], f"{name}.repeated")
        return g.op("Transpose", [x], f"{name}_heads", perm=[0, 2, 1, 3])

    def positions(self) -> CallPositions:
        """The call's position masks, made once per graph (`CallPositions`)."""
        if self._positions is None:
            g = self.g
            s = g.op("Squeeze", [self.s_dim, g.ints(0)], "positions.s")  # scalar
            t = g.op(
                "Range",
                [
                    g.const("positions.zero", np.array(0, np.int64)),
                    s,
                    g.const("positions.step", np.array(1, np.int64)),
                ],
                "positions.t",
            )  # [s]
            rows = g.op("Unsqueeze", [t, g.ints(1)], "positions.rows")  # [s, 1]
            cols = g.op("Unsqueeze", [t, g.ints(0)], "positions.cols")  # [1, s]
            n = g.op("Unsqueeze", [self.names.input_lengths, g.ints(1)], "positions.n")  # [b, 1]
            real = g.op(
                "Cast", [g.op("Less", [cols, n], "positions.real_b")], "positions.real2", to=TensorProto.FLOAT
            )
            self._positions = CallPositions(
                real=g.op("Unsqueeze", [real, g.ints(2)], "positions.real"),  # [b, s, 1]
                causal=g.op("GreaterOrEqual", [rows, cols], "positions.causal"),  # [s, s] bool, j <= i
                strict=g.op("Greater", [rows, cols], "positions.strict"),  # [s, s] bool, j < i
            )
        return self._positions

    def gated_delta_rule(self, i: int, q: str, k: str, v: str, beta: str, decay: str, name: str) -> str:
        """The gated delta rule over the call's s tokens as one chunk (transformers'
        torch_chunk_gated_delta_rule with chunk_size = s), from layer i's recurrent state S0
        [b, nv, dk, dv]; q, k [b, nv, s, dk], v [b, nv, s, dv], beta and the log decay g
        [b, nv, s]. With c = cumsum(g), D[i, j] = exp(c_i - c_j) for j <= i (else 0):

            T      = I + strictly_lower((beta k) k^T * D)                      [s, s], unit lower
            U, W   = T^-1 (beta v), T^-1 (beta k exp(c))
            V'     = U - W S0
            out    = (q exp(c)) S0 + ((q k^T) * D) V'
            S      = S0 exp(c_last) + (k exp(c_last - c))^T V'                  the present state

        T^-1 = (I + N)(I + N^2)(I + N^4)... with N = I - T, exact once 2^factors >= s (N^s = 0):
        DELTA_FACTORS factors cover a call of PREFILL_CHUNK tokens, the most the runtime runs.
        Matmuls only, no token-by-token loop: TensorRT and onnxruntime take it as it is."""
        g, names = self.g, self.names
        where = self.positions()
        kt = g.op("Transpose", [k], f"{name}.kT", perm=[0, 1, 3, 2])  # [b, nv, dk, s]
        cum = g.op(
            "CumSum", [decay, g.const(f"{name}.axis", np.array(2, np.int64))], f"{name}.cum"
        )  # [b, nv, s]
        pair = g.op(
            "Sub",
            [
                g.op("Unsqueeze", [cum, g.ints(3)], f"{name}.cum_i"),
                g.op("Unsqueeze", [cum, g.ints(2)], f"{name}.cum_j"),
            ],
            f"{name}.pair",
        )  # [b, nv, s, s]
        neg_inf = g.fconst(f"{name}.neg_inf", np.array(-np.inf))
        d = g.op(
            "Exp", [g.op("Where", [where.causal, pair, neg_inf], f"{name}.pair_causal")], f"{name}.decay"
        )
        beta4 = g.op("Unsqueeze", [beta, g.ints(3)], f"{name}.beta4")  # [b, nv, s, 1]
        kb = g.op("Mul", [k, beta4], f"{name}.kb")
        vb = g.op("Mul", [v, beta4], f"{name}.vb")
        a = g.op("Mul", [g.op("MatMul", [kb, kt], f"{name}.kbk"), d], f"{name}.a")
        zero = g.fconst(f"{name}.zero", np.array(0.0))
        power = g.op("Neg", [g.op("Where", [where.strict, a, zero], f"{name}.a_strict")], f"{name}.n1")  # N
        ecum = g.op("Unsqueeze", [g.op("Exp", [cum], f"{name}.ecum3"), g.ints(3)], f"{name}.ecum")
        rhs = g.op("Concat", [vb, g.op("Mul", [kb, ecum], f"{name}.kb_decayed")], f"{name}.rhs0", axis=-1)
        for j in range(DELTA_FACTORS):
            rhs = g.op("Add", [rhs, g.op("MatMul", [power, rhs], f"{name}.nr{j}")], f"{name}.rhs{j + 1}")
            if j + 1 < DELTA_FACTORS:
                power = g.op("MatMul", [power, power], f"{name}.n{2 ** (j + 1)}")
        spec = self.spec.delta
        u, w = g.op("Split", [rhs, g.ints(spec.v_dim, spec.k_dim)], f"{name}.uw", outputs=2, axis=-1)
        s0 = names.state(names.past_state, "recurrent", i)
        v_new = g.op("Sub", [u, g.op("MatMul", [w, s0], f"{name}.ws0")], f"{name}.v_new")  # [b, nv, s, dv]
        intra = g.op("Mul", [g.op("MatMul", [q, kt], f"{name}.qk"), d], f"{name}.intra")
        out = g.op(
            "Add",
            [
                g.op("MatMul", [g.op("Mul", [q, ecum], f"{name}.q_decayed"), s0], f"{name}.inter"),
                g.op("MatMul", [intra, v_new], f"{name}.intra_v"),
            ],
            f"{name}.core",
        )
        last = g.op("Slice", [cum, g.ints(-1), g.ints(2**62), g.ints(2)], f"{name}.cum_last")  # [b, nv, 1]
        tail = g.op("Exp", [g.op("Sub", [last, cum], f"{name}.to_last")], f"{name}.tail")  # [b, nv, s]
        k_tail = g.op("Mul", [k, g.op("Unsqueeze", [tail, g.ints(3)], f"{name}.tail4")], f"{name}.k_tail")
        last4 = g.op("Unsqueeze", [g.op("Exp", [last], f"{name}.last_decay"), g.ints(3)], f"{name}.last4")
        kept = g.op("Mul", [s0, last4], f"{name}.s_kept")  # [b, nv, dk, dv]
        written = g.op(
            "MatMul",
            [g.op("Transpose", [k_tail], f"{name}.k_tailT", perm=[0, 1, 3, 2]), v_new],
            f"{name}.s_written",
        )
        g.op("Add", [kept, written], names.state(names.present_state, "recurrent", i))
        return out

    def qk_norm(self, qkv: str, i: int, p: str, parts: list[str]) -> str:
        """qkv [b, s, (h+2kvh)d] of model layer i with Q and K RMS-normed per head, before any
        variant's RoPE (Qwen3); V passes through, or with Gemma 4 is normed without a weight. A
        shared layer's `parts` are Q alone. The Q norm's weight carries the softmax scale
        (`prepare_weights`)."""
        g, d, kvh = self.g, self.spec.layer_head_dim(i), self.geometry.num_kv_heads
        names = [part[0] for part in parts]  # "q", "k", "v"
        if len(parts) > 1:
            splits = g.ints(self.spec.num_heads * d, kvh * d, kvh * d)
            pieces = g.op("Split", [qkv, splits], f"{p}.qkv_parts", outputs=3, axis=-1)
        else:
            pieces = [qkv]
        normed = []
        for part, x in zip(names, pieces, strict=True):
            if part == "v" and not self.spec.gemma4:
                normed.append(x)
                continue
            weight = self.w(f"{p}.{part}_norm.weight") if part != "v" else np.ones(d, np.float32)
            heads = g.op("Reshape", [x, g.ints(0, 0, -1, d)], f"{p}.{part}_heads")  # [b, s, n, d]
            out = self.norms.rms_norm(heads, weight, f"{p}.{part}_norm")
            normed.append(g.op("Reshape", [out, g.ints(0, 0, -1)], f"{p}.{part}_normed"))
        return normed[0] if len(normed) == 1 else g.op("Concat", normed, f"{p}.qkv_normed", axis=-1)

    def mlp(self, x: str, p: str) -> str:
        """Gated MLP: down(act(gate(x)) * up(x)), gate and up as one MatMul; act is SiLU (SwiGLU)
        or Gemma 3's tanh GELU."""
        g = self.g
        gate_up = self.linear(x, p, ["gate_proj", "up_proj"], f"{p}.gate_up")
        width = self.weights[f"{p}.up_proj.weight"].shape[0]  # Gemma 4's shared layers: twice as wide
        gate, up = g.op("Split", [gate_up, g.ints(width, width)], f"{p}.parts", outputs=2, axis=-1)
        if self.spec.activation == "gelu_pytorch_tanh":
            gated = self.gelu_tanh(gate, p)
        else:
            gated = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sig")], f"{p}.silu")
        act = g.op("Mul", [gated, up], f"{p}.act")
        return self.linear(act, p, ["down_proj"], f"{p}.down")

    def gelu_tanh(self, x: str, p: str) -> str:
        """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), torch's approximate='tanh' (Gelu's
        approximate attribute needs opset 20)."""
        g = self.g
        c = self.gelu_consts
        cube = g.op("Mul", [g.op("Mul", [x, x], f"{p}.gelu.x2"), x], f"{p}.gelu.x3")
        inner = g.op("Add", [x, g.op("Mul", [cube, c["cubic"]], f"{p}.gelu.cx3")], f"{p}.gelu.inner")
        t = g.op("Tanh", [g.op("Mul", [inner, c["root"]], f"{p}.gelu.arg")], f"{p}.gelu.tanh")
        return g.op(
            "Mul",
            [g.op("Mul", [x, c["half"]], f"{p}.gelu.half_x"), g.op("Add", [t, c["one"]], f"{p}.gelu.one_t")],
            f"{p}.gelu",
        )

    def logits(self, hidden: str, delta: str) -> str:
        """The final norm, the LM head and the logits output [b, 1 or s, vocab] float32: a float16
        graph's LM head computes in float16 (TensorRT accumulates its products in float32), its
        logits widened before they leave the graph."""
        g = self.g
        scores = g.widen(self.lm_head(self.final_rows(hidden, delta)), "logits.rows_vocab32")  # [rows, vocab]
        if self.spec.gemma4 and self.spec.gemma4.softcap:  # c tanh(logits / c), in float32
            cap = np.array(self.spec.gemma4.softcap, np.float32)
            scaled = g.op("Div", [scores, g.const("logits.softcap", cap)], "logits.capped_in")
            capped = g.op("Tanh", [scaled], "logits.tanh")
            scores = g.op("Mul", [capped, g.const("logits.softcap_out", cap)], "logits.capped")
        vocab = g.const("const.vocab", np.array([self.spec.vocab_size], np.int64))
        seq = {"last": g.ints(1), "rows": g.ints(-1)}.get(self.options.logits, self.s_dim)
        out_shape = g.op("Concat", [self.b_dim, seq, vocab], "shape.logits", axis=0)
        return g.op("Reshape", [scores, out_shape], self.names.logits)

    def final_rows(self, hidden: str, delta: str) -> str:
        """The normed last hidden state of the rows logits are wanted for: [b, H] at each row's
        last_index ("last"), [b*r, H] at last_index [b, r] ("rows"), or [b*s, H] ("all").
        Portable graphs pick the rows before the norm, so it runs on them only; ort graphs keep
        the fused residual norm."""
        if not self.portable:
            hidden, _ = self.norms.residual_norm(hidden, delta, self.w("model.norm.weight"), "model.norm")
            return self._select_rows(hidden)
        if delta is not None:
            hidden = self.g.op("Add", [hidden, delta], "model.residual")
        return self.norms.rms_norm(self._select_rows(hidden), self.w("model.norm.weight"), "model.norm")

    def _select_rows(self, hidden: str) -> str:
        g = self.g
        if self.options.logits == "last":
            index = g.op("Unsqueeze", [self.names.last_index, g.ints(1)], "logits.index")  # [b, 1]
            return g.op("GatherND", [hidden, index], "logits.last_hidden", batch_dims=1)  # [b, H]
        rows = g.const("shape.rows", np.array([-1, self.spec.hidden_size], np.int64))
        if self.options.logits == "rows":
            index = g.op("Unsqueeze", [self.names.last_index, g.ints(2)], "logits.index")  # [b, r, 1]
            hidden = g.op("GatherND", [hidden, index], "logits.row_hidden", batch_dims=1)  # [b, r, H]
        return g.op("Reshape", [hidden, rows], "logits.rows")

    def lm_head(self, hidden: str) -> str:
        """hidden [rows, H] @ head^T: the embedding table when tied (stored once, float weights)."""
        g, options = self.g, self.options
        tied = tied_head(self.spec, self.weights)
        if options.quantized:
            head = self.w("model.embed_tokens.weight" if tied else "lm_head.weight")  # [vocab, H]
            return matmul_weight(
                g,
                hidden,
                head.T,  # a view: the quantizer copies a few columns at a time
                HEAD_TABLE,
                options.lm_head_bits,
                options.block_size,
                self.outliers.get("lm_head"),
                rank=2,
                blocks=self.kept.get("model.embed_tokens.weight" if tied else "lm_head.weight"),
            )
        if tied:
            head_name = self.embed_name
        else:
            stored_half = options.weights == "float16"
            head_name = g.float_weight("lm_head.weight", self.w("lm_head.weight"), stored_half)
        return g.op("Gemm", [hidden, head_name], "logits.rows_vocab", transB=1)
