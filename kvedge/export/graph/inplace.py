"""The ort variant's in-place attentions: onnxruntime's GroupQueryAttention, and kvedge's
Int8CacheAttention and Int4CacheAttention kernels over the INT8 and int4 caches; past and present
share one buffer. Gemma 4's
shared-KV layers attend over their source layer's buffer in standard ops (`SharedReads`).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kvedge.contract import (
    INT4_ATTENTION_OP,
    INT8_ATTENTION_OP,
    KVEDGE_OPS_DOMAIN,
    VERIFY_TOKENS,
    CacheGeometry,
)
from kvedge.export.graph.int8_codec import Int8Codec
from kvedge.export.graph.options import MS_DOMAIN
from kvedge.export.graph.rope import position_angles, rotate_half


class InPlaceAttention:
    """What the in-place attentions share: the heads, the RoPE tables (cos, sin [L, d/2]) and, for
    sliding-window layers (Gemma 3 and 4), their own tables (of their own head_dim `local_d`, Gemma
    4) and a window over the full-length cache; and the shared-KV layers' reads (`shared`)."""

    def __init__(
        self,
        g,
        heads,
        kv_heads,
        d,
        names,
        s_dim,
        cos_table,
        sin_table,
        local_cos=None,
        local_sin=None,
        window=0,
        local_d=0,
        group_size=0,  # the INT8 cache's channels per scale; 0: a float cache
    ) -> None:
        self.g, self.names, self.heads, self.kv_heads = g, names, heads, kv_heads
        self.d, self.local_d, self.s_dim, self.group_size = d, local_d or d, s_dim, group_size
        self.cos_table, self.sin_table = cos_table, sin_table
        self.local_cos, self.local_sin, self.window = local_cos, local_sin, window
        self._shared: SharedReads | None = None  # made by the first shared layer

    def shared(self, i: int, layer: int, q: str, local: bool = False) -> str:
        """Model layer `layer`'s attention (Gemma 4's shared-KV layers: queries q [b, s, heads*d]
        of their own, no K or V) over KV layer i's cache, which i's attention wrote this call's
        tokens into: [b, s, heads*d] (`SharedReads`)."""
        if self._shared is None:
            self._shared = SharedReads(self)
        return self._shared.attend(i, layer, q, local)


class SharedReads:
    """Gemma 4's shared-KV layers in an ort graph, in standard ops: GroupQueryAttention and the INT8
    kernel attend over a cache they append to, and hand on neither what they read nor the new
    tokens' rotated K/V, so a shared layer reads its source layer's present buffer (the past buffer
    itself, which the source wrote this call's tokens into; the data dependency orders it after the
    source) up to A + s, A = max(past_lengths), and masks it per row::

        q        = rope(q) at positions past_lengths[b] + t                [b, kvh, g*s, d]
        K, V     = present[..., :A+s, :]        (INT8: codes and scales, `Int8Codec`)
        visible  = j <= past_lengths[b] + t     (sliding: and > past_lengths[b] + t - window)
        out      = softmax(q K^T + mask) V

    K and V are sliced once per source layer, the masks and angles made once per layer type. A
    sliding layer reads the whole valid length, its mask keeping the window: the work of a full
    layer's attention, as a portable graph's full layers do."""

    def __init__(self, attention: InPlaceAttention) -> None:
        self.a = attention
        g, names = attention.g, attention.names
        s = g.op("Squeeze", [attention.s_dim, g.ints(0)], "shared.s")  # scalar
        zero = g.const("shared.zero", np.array(0, np.int64))
        one = g.const("shared.one", np.array(1, np.int64))
        t = g.op("Range", [zero, s, one], "shared.t")  # [s]
        lengths = g.op("Unsqueeze", [names.past_lengths, g.ints(1)], "shared.lengths")  # [b, 1]
        self.positions = g.op("Add", [lengths, g.op("Unsqueeze", [t, g.ints(0)], "shared.t2")], "shared.pos")
        longest = g.reduce("ReduceMax", names.past_lengths, 0, "shared.longest")  # [1]
        self.read_len = g.op("Add", [longest, attention.s_dim], "shared.read_len")  # [1] A + s
        keys = g.op("Range", [zero, g.op("Squeeze", [self.read_len, g.ints(0)], "shared.n"), one], "shared.j")
        # [b, s, 1] query positions against [1, 1, A+s] key positions
        self.distance = g.op(
            "Sub",
            [
                g.op("Unsqueeze", [self.positions, g.ints(2)], "shared.pos3"),
                g.op("Unsqueeze", [keys, g.ints(0, 1)], "shared.j3"),
            ],
            "shared.distance",
        )  # [b, s, A+s]: position of the query minus that of the key
        self.zero_f = g.const("shared.zero_f", np.array(0.0, np.float32))
        self.neg_inf = g.const("shared.neg_inf", np.array(-np.inf, np.float32))
        self.masks: dict[bool, str] = {}  # by `local`: [b, 1, g*s, A+s]
        self.angles: dict[bool, tuple[str, str]] = {}  # by `local`: cos, sin [b, 1, s, d/2]
        self.codecs: dict[bool, Int8Codec] = {}  # by `local`, INT8 caches
        self.read: dict[int, tuple[str, ...]] = {}  # by KV layer: its present cut to A+s (`source`)

    def mask(self, local: bool) -> str:
        """The additive mask [b, 1, g*s, A+s] of one layer type, made once."""
        if local not in self.masks:
            g, kind = self.a.g, "local" if local else "global"
            visible = g.op("GreaterOrEqual", [self.distance, g.ints(0)], f"shared.{kind}.causal")
            if local:
                near = g.op("Less", [self.distance, g.ints(self.a.window)], "shared.local.near")
                visible = g.op("And", [visible, near], "shared.local.visible")
            bias = g.op("Where", [visible, self.zero_f, self.neg_inf], f"shared.{kind}.bias")  # [b, s, A+s]
            groups = self.a.heads // self.a.kv_heads
            self.masks[local] = g.op(
                "Tile",
                [g.op("Unsqueeze", [bias, g.ints(1)], f"shared.{kind}.bias4"), g.ints(1, 1, groups, 1)],
                f"shared.{kind}.mask",
            )
        return self.masks[local]

    def rope(self, q: str, local: bool, d: int, name: str) -> str:
        """q [b, heads, s, d] rotated at the call's positions with the layer type's tables."""
        a, g = self.a, self.a.g
        if local not in self.angles:
            tables = (a.local_cos, a.local_sin) if local else (a.cos_table, a.sin_table)
            kind = "local" if local else "global"
            self.angles[local] = position_angles(g, self.positions, *tables, f"shared.{kind}.rope")
        return rotate_half(g, q, *self.angles[local], g.ints(d // 2, d // 2), name)

    def attend(self, i: int, layer: int, q: str, local: bool) -> str:
        """Model layer `layer`'s queries q [b, s, heads*d] over KV layer i's present buffer ->
        [b, s, heads*d]."""
        a, g = self.a, self.a.g
        p, d = f"model.layers.{layer}.attn", a.local_d if local else a.d
        heads, kvh = a.heads, a.kv_heads
        q = g.op(
            "Transpose",
            [g.op("Reshape", [q, g.ints(0, 0, heads, d)], f"{p}.q4")],
            f"{p}.q_bhsd",
            perm=[0, 2, 1, 3],
        )
        q = g.op("Reshape", [self.rope(q, local, d, f"{p}.q_rope"), g.ints(0, kvh, -1, d)], f"{p}.q_grouped")
        read = self.source(i)
        codec = self.codec(local, d) if a.group_size else None
        if codec:
            scores = codec.past_scores(q, read[0], read[2], f"{p}.shared_k")
        else:
            k_t = g.op("Transpose", [read[0]], f"{p}.shared_kT", perm=[0, 1, 3, 2])
            scores = g.op("MatMul", [q, k_t], f"{p}.shared_scores")  # [b, kvh, g*s, A+s]
        probs = g.op(
            "Softmax",
            [g.op("Add", [scores, self.mask(local)], f"{p}.shared_masked")],
            f"{p}.shared_probs",
            axis=-1,
        )
        if codec:
            context = codec.past_context(probs, read[1], read[3], f"{p}.shared_v")
        else:
            context = g.op("MatMul", [probs, read[1]], f"{p}.shared_context")  # [b, kvh, g*s, d]
        return g.merged_heads(context, heads, d, p)  # [b, s, heads*d]

    def source(self, i: int) -> tuple[str, ...]:
        """KV layer i's present tensors cut to their first A + s positions, once per source layer:
        K, V [b, kvh, A+s, d], and with the INT8 cache codes then K, V scales [b, kvh, A+s, groups]
        (`IONames.present` order), so the codec widens those positions only."""
        if i not in self.read:
            g, names = self.a.g, self.a.names
            present = [names.layer(t, i) for t in names.present(bool(self.a.group_size))]
            self.read[i] = tuple(
                g.op("Slice", [t, g.ints(0), self.read_len, g.ints(2)], f"shared.{i}.part{n}")
                for n, t in enumerate(present)
            )
        return self.read[i]

    def codec(self, local: bool, d: int) -> Int8Codec:
        """The INT8 cache's reads over A + s positions for one layer type (its head_dim `d`)."""
        if local not in self.codecs:
            kind = "local" if local else "global"
            self.codecs[local] = Int8Codec(
                self.a.g, self.a.kv_heads, d, self.a.group_size, self.read_len, f"shared.{kind}.int8"
            )
        return self.codecs[local]


class GroupQueryAttention(InPlaceAttention):
    """onnxruntime's GroupQueryAttention, past and present sharing one buffer (package docstring).

    `half` (a float16 cache, the onnxruntime CUDA form): Q/K/V are cast to float16 before the op
    and its output back to float32, the cache and RoPE tables are float16; the rest of the graph
    is unchanged. Everything the op reads is then fixed in shape and made on the device, so the
    CUDA provider can capture the decode step as a CUDA graph: seqlens_k comes from the token
    ids' own row length (ReduceSum of ones), never from a Shape, whose value would sit in host
    memory and be copied to the device each step; and total_sequence_length, which the CUDA
    kernel reads on the host, is the constant max_len instead of max(past_lengths) + s, which
    would be copied from the device each step (a sync no capture can hold). The op then sizes
    its work from seqlens_k per row; with total > s a prefill counts as a continuation, which
    it takes for batch 1 only, as the runtime already calls it."""

    def __init__(self, g, heads, kv_heads, d, length, names, s_dim, half=False, **tables) -> None:
        super().__init__(g, heads, kv_heads, d, names, s_dim, **tables)
        self.half = half
        if half:
            ones = g.op(
                "Cast",
                [g.op("Equal", [names.input_ids] * 2, "gqa.ones_bool")],
                "gqa.ones",
                to=TensorProto.INT32,
            )  # [b, s]
            new = g.op("ReduceSum", [ones, g.ints(1)], "gqa.new_tokens", keepdims=0)  # [b] = s
            past = g.op("Cast", [names.past_lengths], "gqa.past_i32", to=TensorProto.INT32)
            one = g.const("gqa.one_i32", np.array([1], np.int32))
            last = g.op("Sub", [new, one], "gqa.s_minus_1")
            self.seqlens = g.op("Add", [past, last], "gqa.seqlens_k")  # [b] int32
            self.total = g.const("gqa.total_sequence_length", np.array(length, np.int32))  # scalar
            return
        s_minus_1 = g.op("Sub", [s_dim, g.ints(1)], "gqa.s_minus_1")
        seqlens = g.op("Add", [names.past_lengths, s_minus_1], "gqa.seqlens_i64")  # [b]
        self.seqlens = g.op("Cast", [seqlens], "gqa.seqlens_k", to=TensorProto.INT32)
        longest = g.reduce("ReduceMax", names.past_lengths, 0, "gqa.longest_past", keepdims=0)
        total = g.op("Add", [longest, g.op("Squeeze", [s_dim], "gqa.s_scalar")], "gqa.total_i64")
        self.total = g.op("Cast", [total], "gqa.total_sequence_length", to=TensorProto.INT32)  # scalar

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        """Layer i; a sliding-window layer (`local`) attends to the key at its own position and
        the window - 1 before it: local_window_size = window (onnxruntime 1.32 CPU, checked
        against transformers in tests/test_gemma3.py; window - 1 differs by ~2 in the logits)."""
        g, names, p = self.g, self.names, f"model.layers.{i}.attn"
        tables = [self.cos_table, self.sin_table] if rotate else []
        if local:
            tables = [self.local_cos, self.local_sin]
        if self.half:
            qkv = g.op("Cast", [qkv], f"{p}.qkv16", to=TensorProto.FLOAT16)  # [b, s, (h+2kvh)d]
        merged = g.op(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                names.layer(names.past_key, i),
                names.layer(names.past_value, i),
                self.seqlens,
                self.total,
                *tables,
            ],
            f"{p}.gqa",
            outputs=[
                f"{p}.merged16" if self.half else f"{p}.merged",  # [b, s, heads*d]
                names.layer(names.present_key, i),
                names.layer(names.present_value, i),
            ],
            domain=MS_DOMAIN,
            num_heads=self.heads,
            kv_num_heads=self.kv_heads,
            scale=1.0,  # folded into Wq
            do_rotary=int(rotate),
            rotary_interleaved=0,
            local_window_size=self.window if local else -1,
        )[0]
        return g.op("Cast", [merged], f"{p}.merged", to=TensorProto.FLOAT) if self.half else merged


class Int8CacheAttention(InPlaceAttention):
    """kvedge's own onnxruntime kernel (`kvedge/runtime/csrc/kvedge_ops.cc`): GroupQueryAttention's
    counterpart over the INT8 cache, past and present sharing one buffer per tensor."""

    def __init__(self, g, heads, kv_heads, d, length, names, s_dim, **tables) -> None:
        super().__init__(g, heads, kv_heads, d, names, s_dim, **tables)
        self.identity_shape = (length, d // 2)
        self.identity: list[str] = []

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        """Layer i; a sliding-window layer (`local`) attends as GroupQueryAttention's does: to the
        key at its own position and the window - 1 before it (local_window_size = window)."""
        g, names = self.g, self.names
        past = [names.layer(t, i) for t in names.past(True)]  # K, V codes, K, V scales
        tables = [self.local_cos, self.local_sin] if local else self.tables(rotate)
        return g.op(
            INT8_ATTENTION_OP,
            [qkv, names.past_lengths, *past, *tables],
            f"model.layers.{i}.attn.int8",
            outputs=[f"model.layers.{i}.attn.merged", *[names.layer(t, i) for t in names.present(True)]],
            domain=KVEDGE_OPS_DOMAIN,
            num_heads=self.heads,
            kv_num_heads=self.kv_heads,
            local_window_size=self.window if local else -1,
            decode_steps=VERIFY_TOKENS,  # a verify's rows attended as decode steps, to the bit
        )[0]

    def tables(self, rotate: bool) -> list[str]:
        """The RoPE tables, or for a layer without RoPE tables of angle 0 (cos 1, sin 0 [L, d/2]):
        the kernel always rotates, and a rotation by 0 is exactly the identity."""
        if rotate:
            return [self.cos_table, self.sin_table]
        if not self.identity:
            self.identity = [
                self.g.const("rope.cos_none", np.ones(self.identity_shape, np.float32)),
                self.g.const("rope.sin_none", np.zeros(self.identity_shape, np.float32)),
            ]
        return self.identity


class Int4CacheAttention(Int8CacheAttention):
    """kvedge's kernel over the int4 cache (kvedge/kv4.py): codes, scales and the float32 window
    of each layer, past and present sharing one buffer per tensor; each layer's key bits
    (`CacheGeometry.key_bits`) and the window are attributes. No sliding-window layers (the int4
    geometry refuses them)."""

    def __init__(
        self, g, heads, kv_heads, d, length, names, s_dim, geometry: CacheGeometry, **tables
    ) -> None:
        super().__init__(g, heads, kv_heads, d, length, names, s_dim, **tables)
        self.geometry = geometry

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        g, names = self.g, self.names
        # the kernel's order: K codes, K scales, V codes, V scales, K window, V window
        order = (0, 2, 1, 3, 4, 5)
        past = [names.layer(names.cache_past(self.geometry)[j], i) for j in order]
        present = [names.layer(names.cache_present(self.geometry)[j], i) for j in order]
        return g.op(
            INT4_ATTENTION_OP,
            [qkv, names.past_lengths, *past, *self.tables(rotate)],
            f"model.layers.{i}.attn.int4",
            outputs=[f"model.layers.{i}.attn.merged", *present],
            domain=KVEDGE_OPS_DOMAIN,
            num_heads=self.heads,
            kv_num_heads=self.kv_heads,
            key_bits=self.geometry.key_bits(i),
            window=self.geometry.float_window,
            decode_steps=VERIFY_TOKENS,
        )[0]
