"""The decoder, block by block, on one `Builder`: embeddings, layers (norms, QKV, the variant's
attention, the gated MLP) and the logits; `build_decoder_graph` is the entry point.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx

from kvedge.contract import (
    HEAD_TABLE,
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
from kvedge.export.graph.forms import onnx_model
from kvedge.export.graph.inplace import GroupQueryAttention, Int8CacheAttention
from kvedge.export.graph.norms import Norms
from kvedge.export.graph.options import HALF_KV_DTYPES, DecoderSpec, check_ring, graph_opset
from kvedge.export.graph.portable import PortableAttention, RingSpec
from kvedge.export.graph.quant_matmul import block_weight, matmul_weight
from kvedge.export.graph.weights import prepare_weights, tied_head
from kvedge.export.quantize import QuantizedWeight, concat_columns


def build_decoder_graph(
    spec: DecoderSpec,
    geometry: CacheGeometry,
    weights: dict[str, np.ndarray],
    cos: np.ndarray,
    sin: np.ndarray,
    names: IONames,
    options: ExportRecipe,
    progress: Callable[[int], None] | None = None,
    outliers: dict[str, np.ndarray] | None = None,
    local_tables: tuple[np.ndarray, np.ndarray] | None = None,
    kept: dict[str, QuantizedWeight] | None = None,
) -> onnx.ModelProto:
    """The decoder as an ONNX model. `weights` uses Hugging Face state-dict names and layouts;
    `outliers` ({Linear name: input channels}, `quantize.input_outliers`) are kept float32 in
    quantized matmuls; `local_tables` (cos, sin [max_len, d/2]) rotate the sliding-window layers
    (`spec.local_layers`: Gemma 3's, their own RoPE base), `cos`/`sin` every other layer; `kept`
    (HF name: blocks [K, N], `weights.SourceBlocks.kept`) are stored as they are, not quantized."""
    check_kv_dtype(geometry.dtype, options.variant, options.precision)
    check_ring(geometry, options.variant)
    if spec.local_layers and local_tables is None:
        raise KvedgeError("sliding-window layers need their RoPE tables (local_tables)")
    if spec.local_layers and geometry.ring_layers not in ((), spec.local_layers):
        raise KvedgeError(
            f"ring layers {list(geometry.ring_layers)} are not the model's sliding-window layers "
            f"{list(spec.local_layers)}"
        )
    prepared = prepare_weights(spec, geometry, weights)
    kept_blocks = prepare_weights(spec, geometry, kept or {})
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
            outliers or {},
            local_tables,
            decode_form,
            kept_blocks,
        )
        hidden, delta = decoder.embed(), None  # delta: the last sublayer's output, added by the next norm
        for i in range(spec.num_layers or geometry.num_layers):
            hidden, delta = decoder.layer(i, hidden, delta)
            if progress:
                progress(1 / len(forms))
        decoder.logits(hidden, delta)
        builders.append(decoder.g)
    embeds = ("float16" if options.half else "float32") if runtime_embeddings(options) else ""
    interface = GraphInterface(
        names, geometry, options.variant, options.logits, spec.vocab_size, spec.hidden_size, embeds
    )
    return onnx_model(builders, interface, options)


def runtime_embeddings(options: ExportRecipe) -> bool:
    """The graph takes inputs_embeds, which the runtime looks up (`kvedge.contract.EmbeddingTable`:
    the quantized tied LM head's blocks, or an untied model's table quantized to 8 bits beside the
    graph), instead of gathering rows of a float table: a quantized graph."""
    return options.quantized


class Decoder:
    """The decoder's blocks as ops on one `Builder`: tensors shared by all layers are made at
    construction, then `embed`, `layer` (once per layer) and `logits` add the rest in order."""

    def __init__(
        self,
        spec: DecoderSpec,
        geometry: CacheGeometry,
        weights: dict[str, np.ndarray],
        cos: np.ndarray,
        sin: np.ndarray,
        names: IONames,
        options: ExportRecipe,
        outliers: dict[str, np.ndarray],
        local_tables: tuple[np.ndarray, np.ndarray] | None = None,
        decode_form: bool = False,
        kept: dict[str, QuantizedWeight] | None = None,
    ) -> None:
        self.spec, self.weights, self.names, self.options = spec, weights, names, options
        self.geometry = geometry
        self.outliers = outliers  # {Linear name: input channels kept float32 when quantized}
        self.kept = kept or {}  # {HF name: the source's blocks [K, N], stored as they are}
        self.portable = options.variant == "portable"
        ops = kvedge_ops(options.variant, geometry.dtype, options.weights)
        self.g = g = Builder(
            graph_opset(options), SIDE_INPUTS_OP in ops, decode_form, options.half, self.portable
        )
        # a float16 graph over the INT8 cache runs attention in float32, as a float32 graph does:
        # its codec's products of a query with int8 codes before scaling can pass 65504
        self.wide_attention = options.half and geometry.quantized
        self.norms = Norms(g, spec.rms_norm_eps, fused=not self.portable)
        batch_seq = g.op("Shape", [names.input_ids], "shape.bs")  # [2] = (b, s)
        self.b_dim = g.op("Slice", [batch_seq, g.ints(0), g.ints(1)], "shape.b")  # [1]
        self.s_dim = g.op("Slice", [batch_seq, g.ints(1), g.ints(2)], "shape.s")  # [1]
        self.attention = self._attention(geometry, cos, sin, local_tables)
        self.mlp_split = g.const("mlp.split", np.array([spec.intermediate_size] * 2, np.int64))
        if spec.activation == "gelu_pytorch_tanh":
            consts = {"cubic": 0.044715, "root": math.sqrt(2.0 / math.pi), "half": 0.5, "one": 1.0}
            self.gelu_consts = {k: g.fconst(f"gelu.{k}", np.array(v)) for k, v in consts.items()}
        if spec.qk_norm:
            d, kv_heads = geometry.head_dim, geometry.num_kv_heads
            self.qkv_split = g.ints(spec.num_heads * d, kv_heads * d, kv_heads * d)
            self.per_head = g.ints(0, 0, -1, d)
            self.merged_heads = g.ints(0, 0, -1)

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
        if geometry.ring_layers:  # portable only (`check_ring`)
            ring = RingSpec(geometry.ring_len, geometry.window, local["local_cos"], local["local_sin"])
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
        if geometry.quantized:
            return Int8CacheAttention(**ctx, **tables, **local)
        return GroupQueryAttention(**ctx, **tables, **local, half=half)

    def w(self, name: str) -> np.ndarray:
        return self.weights[name].astype(np.float32)

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
        inputs_embeds the runtime looks up in a quantized graph (`runtime_embeddings`). The table
        is kept for a tied LM head."""
        self.embed_table = self.w("model.embed_tokens.weight")  # [vocab, hidden]
        if runtime_embeddings(self.options):
            rows = self.names.inputs_embeds
        else:
            self.embed_name = self.g.float_weight(
                "model.embed_tokens.weight", self.embed_table, stored_half=self.options.weights == "float16"
            )
            rows = self.g.op("Gather", [self.embed_name, self.names.input_ids], "model.embed", axis=0)
        if self.spec.embed_scale == 1.0:
            return rows
        scale = self.g.fconst("model.embed_scale", np.array(self.spec.embed_scale, np.float32))
        return self.g.op("Mul", [rows, scale], "model.embed_scaled")

    def layer(self, i: int, hidden: str, delta: str | None) -> tuple[str, str]:
        """Decoder layer i: attention and MLP blocks. Returns (residual stream, MLP output)."""
        p = f"model.layers.{i}"
        x, hidden = self.norms.residual_norm(
            hidden, delta, self.w(f"{p}.input_layernorm.weight"), f"{p}.input_layernorm"
        )
        if i in self.spec.conv_layers:
            delta = self.short_conv(i, x)
            x, hidden = self.norms.residual_norm(
                hidden, delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm"
            )
            return hidden, self.mlp(x, f"{p}.mlp")
        qkv = self.linear(
            x, f"{p}.self_attn", ["q_proj", "k_proj", "v_proj"], f"{p}.attn.qkv"
        )  # [b, s, (h+2kvh)d]
        if self.spec.qk_norm:
            qkv = self.qk_norm(qkv, f"{p}.self_attn")
        if self.wide_attention:
            qkv = self.g.widen(qkv, f"{p}.attn.qkv32")
        kv = self.geometry.kv_index(i)  # the index of its cache tensors' names
        if i in self.spec.local_layers:
            attn = self.attention.layer(kv, qkv, local=True)  # [b, s, heads*d]
        else:
            attn = self.attention.layer(kv, qkv, rotate=i not in self.spec.unrotated_layers)
        if self.wide_attention:
            attn = self.g.narrow(attn, f"{p}.attn.merged16")
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
            out = self.mlp(x, f"{p}.mlp")
            return hidden, self.norms.rms_norm(
                out, self.w(f"{p}.post_feedforward_layernorm.weight"), f"{p}.post_feedforward_layernorm"
            )
        x, hidden = self.norms.residual_norm(
            hidden, delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm"
        )
        return hidden, self.mlp(x, f"{p}.mlp")

    def short_conv(self, i: int, x: str) -> str:
        """LFM2's gated short convolution of layer i over x [b, s, H] (transformers' Lfm2ShortConv):
        B, C, h = in_proj(x); u = B * h; y = C * conv(u); out_proj(y), where conv is causal and
        depthwise over kernel k: conv(u)[t] = sum_j w[:, j] * u[t + j - (k - 1)] (+ bias), the
        positions before the call's first token read from the slot's state, its last k - 1 inputs
        [b, k - 1, H]. The new state is the k - 1 inputs ending at each row's last real token
        (input_lengths: a right-padded row's padding never enters it; a row of none keeps its
        state)."""
        g, names, p, k = self.g, self.names, f"model.layers.{i}", self.spec.conv_kernel
        h = self.spec.hidden_size
        bcx = self.linear(x, f"{p}.conv", ["in_proj"], f"{p}.conv.in")  # [b, s, 3H]
        b, c, u = g.op("Split", [bcx, g.ints(h, h, h)], f"{p}.conv.parts", outputs=3, axis=-1)
        u = g.op("Mul", [b, u], f"{p}.conv.bx")  # [b, s, H]
        past = names.state(names.past_state, "conv", i)
        run = g.op("Concat", [past, u], f"{p}.conv.run", axis=1)  # [b, k - 1 + s, H]
        w = self.w(f"{p}.conv.conv.weight")[:, 0, :]  # [H, k]
        out = None
        for j in range(k):
            end = g.op("Add", [self.s_dim, g.ints(j)], f"{p}.conv.end{j}")
            tap = g.op("Slice", [run, g.ints(j), end, g.ints(1)], f"{p}.conv.tap{j}")  # [b, s, H]
            term = g.op(
                "Mul", [tap, g.fconst(f"{p}.conv.w{j}", np.ascontiguousarray(w[:, j]))], f"{p}.conv.t{j}"
            )
            out = term if out is None else g.op("Add", [out, term], f"{p}.conv.sum{j}")
        bias = f"{p}.conv.conv.bias"
        if bias in self.weights:
            out = g.op("Add", [out, g.fconst(f"{p}.conv.bias", self.w(bias))], f"{p}.conv.biased")
        y = g.op("Mul", [c, out], f"{p}.conv.gated")  # [b, s, H]
        # the new state: run[r, n_r : n_r + k - 1] for each row's n_r real tokens
        offsets = g.const(f"{p}.conv.offsets", np.arange(k - 1, dtype=np.int64)[None, :])  # [1, k-1]
        starts = g.op("Unsqueeze", [names.input_lengths, g.ints(1)], f"{p}.conv.n")  # [b, 1]
        index = g.op("Add", [starts, offsets], f"{p}.conv.kept")  # [b, k - 1]
        index = g.op("Unsqueeze", [index, g.ints(2)], f"{p}.conv.kept3")  # [b, k - 1, 1]
        g.op("GatherND", [run, index], names.state(names.present_state, "conv", i), batch_dims=1)
        return self.linear(y, f"{p}.conv", ["out_proj"], f"{p}.conv.out")

    def qk_norm(self, qkv: str, p: str) -> str:
        """qkv [b, s, (h+2kvh)d] with Q and K RMS-normed per head, before any variant's RoPE (Qwen3);
        V passes through. The Q norm's weight carries the softmax scale (`prepare_weights`)."""
        g = self.g
        q, k, v = g.op("Split", [qkv, self.qkv_split], f"{p}.qkv_parts", outputs=3, axis=-1)
        normed = [
            g.op(
                "Reshape",
                [
                    self.norms.rms_norm(
                        g.op("Reshape", [x, self.per_head], f"{p}.{part}_heads"),  # [b, s, n, d]
                        self.w(f"{p}.{part}_norm.weight"),
                        f"{p}.{part}_norm",
                    ),
                    self.merged_heads,
                ],
                f"{p}.{part}_normed",
            )
            for part, x in (("q", q), ("k", k))
        ]
        return g.op("Concat", [*normed, v], f"{p}.qkv_normed", axis=-1)

    def mlp(self, x: str, p: str) -> str:
        """Gated MLP: down(act(gate(x)) * up(x)), gate and up as one MatMul; act is SiLU (SwiGLU)
        or Gemma 3's tanh GELU."""
        g = self.g
        gate_up = self.linear(x, p, ["gate_proj", "up_proj"], f"{p}.gate_up")
        gate, up = g.op("Split", [gate_up, self.mlp_split], f"{p}.parts", outputs=2, axis=-1)
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
            head = self.embed_table if tied else self.w("lm_head.weight")  # [vocab, H]
            return matmul_weight(
                g,
                hidden,
                np.ascontiguousarray(head.T),
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
