"""The portable variant's attention, standard ops only (TensorRT reads them): the valid part of the
past sliced, GQA as a reshape of Q, the mask made once per call from `past_lengths`, and the
sliding-window layers' rings (see the package docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from kvedge.export.graph.int8_codec import Int8Codec
from kvedge.export.graph.rope import position_angles, rotate_half


@dataclass(frozen=True)
class RingSpec:
    """What the portable graph needs to build the ring layers' attention (`PortableAttention._ring`)."""

    ring_len: int  # positions per ring layer (geometry.ring_len)
    window: int  # keys a query sees, itself included
    cos_table: str  # the ring layers' RoPE tables [max_len, d/2] (Gemma 3: the local base)
    sin_table: str
    head_dim: int = 0  # the ring layers' head_dim (geometry.ring_dim); 0: the full layers'


@dataclass(frozen=True)
class RingInputs:
    """Per-call tensors shared by every ring layer; the full layers' counterparts live on
    `PortableAttention` under the same names."""

    cos4: str  # [b, 1, s, d/2]
    sin4: str
    attend: str  # [1] ring indices read: min(max(past_lengths), ring_len)
    mask: str  # [b, 1, g*s, A_r+s]
    split_as: str  # [2] (A_r, s)
    codec: Int8Codec | None
    d: int  # the ring layers' head_dim


@dataclass(frozen=True)
class LayerKV:
    """What a layer's attention read, which a layer sharing its KV (Gemma 4) reads again."""

    k: str  # the new tokens' K [b, kvh, s, d] (after RoPE; as the cache will hold it)
    v: str  # and V
    past: tuple[str, ...]  # the past as attention read it: K, V [b, kvh, A, d] (sliced), or the
    # INT8 cache's codes and scales (`IONames.past` order)


class PortableAttention:
    """Standard-op attention over the valid part of the past (see the package docstring)."""

    def __init__(
        self,
        g,
        heads,
        kv_heads,
        d,
        length,
        names,
        s_dim,
        b_dim,
        cos_table,
        sin_table,
        kv_group_size=0,
        ring: RingSpec | None = None,
        half=False,  # over a float16 cache: float16 but for the softmax (package docstring)
    ) -> None:
        self.g, self.names, self.half = g, names, half
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        groups = heads // kv_heads
        self.read: dict[int, LayerKV] = {}  # by KV layer: what its attention read (`shared`)

        # RoPE angles [b, 1, s, d/2] each, shared by all layers (ring layers: by all ring layers).
        self.cos4, self.sin4 = position_angles(g, names.position_ids, cos_table, sin_table, "rope")

        # A = longest valid past in the batch: attention reads positions [0, A) only.
        self.attend = longest = g.reduce("ReduceMax", names.past_lengths, 0, "attn.attend_len")  # [1]
        self.codec = Int8Codec(g, kv_heads, d, kv_group_size, longest) if kv_group_size else None
        self.neg_inf = g.const("const.neg_inf", np.array(-np.inf, np.float32))
        self.zero_f = g.const("const.zero_f", np.array(0.0, np.float32))
        self.mask, lengths, rows, new_idx = self._mask(length, b_dim, s_dim, groups)  # [b, 1, g*s, A+s]
        self.split_as = g.op("Concat", [longest, s_dim], "attn.split_as", axis=0)
        self.ring = None
        if ring is not None:
            self.ring = self._ring(ring, lengths, rows, new_idx, b_dim, s_dim, groups, kv_group_size)

    def _mask(self, length: int, b_dim: str, s_dim: str, groups: int) -> tuple[str, str, str, str]:
        """The full layers' mask [b, 1, g*s, A+s], shared by them: position j of row b visible iff
        j < past_lengths[b], new token k to new token i iff k <= i; with the tensors the ring mask
        reuses (lengths [b, 1], rows [s, 1], new_idx [s])."""
        g, names, longest = self.g, self.names, self.attend
        zero_f, neg_inf = self.zero_f, self.neg_inf
        positions = g.op(
            "Slice",
            [
                g.const("mask.all_positions", np.arange(length, dtype=np.int64)[None, :]),
                g.ints(0),
                longest,
                g.ints(1),
            ],
            "mask.positions",
        )  # [1, A]
        lengths = g.op("Unsqueeze", [names.past_lengths, g.ints(1)], "mask.lengths")  # [b, 1]
        past_ok = g.op("Less", [positions, lengths], "mask.past_ok")  # [b, A]
        past_bias = g.op("Where", [past_ok, zero_f, neg_inf], "mask.past_bias")
        past_bias4 = g.op("Unsqueeze", [past_bias, g.ints(1, 2)], "mask.past4")
        scalar_s = g.op("Squeeze", [s_dim, g.ints(0)], "shape.s_scalar")
        new_idx = g.op(
            "Range",
            [
                g.const("const.zero_scalar", np.array(0, np.int64)),
                scalar_s,
                g.const("const.one_scalar", np.array(1, np.int64)),
            ],
            "mask.new_idx",
        )
        rows = g.op("Unsqueeze", [new_idx, g.ints(1)], "mask.rows")  # [s, 1]
        causal = g.op(
            "LessOrEqual", [g.op("Unsqueeze", [new_idx, g.ints(0)], "mask.cols"), rows], "mask.causal"
        )
        new_bias = g.op("Where", [causal, zero_f, neg_inf], "mask.new_bias")  # [s, s]
        past_shape = g.op("Concat", [b_dim, g.ints(1), s_dim, longest], "mask.past_shape", axis=0)
        new_shape = g.op("Concat", [b_dim, g.ints(1), s_dim, s_dim], "mask.new_shape", axis=0)
        mask = g.op(
            "Concat",
            [
                g.op("Expand", [past_bias4, past_shape], "mask.past_full"),
                g.op("Expand", [new_bias, new_shape], "mask.new_full"),
            ],
            "mask.bs",
            axis=-1,
        )  # [b, 1, s, A+s]
        mask = g.op("Tile", [mask, g.ints(1, 1, groups, 1)], "mask")  # [b, 1, g*s, A+s]
        return mask, lengths, rows, new_idx

    def _ring(
        self, spec: RingSpec, lengths, rows, new_idx, b_dim, s_dim, groups, kv_group_size
    ) -> RingInputs:
        """The ring layers' angles, valid slice and mask (`RingSpec`), shared by those layers.

        Ring index j of a ring of R holds position stored(j) = P - 1 - ((P - 1 - j) mod R) for a
        row of valid length P: the latest position below P that lands on j (negative where none
        has). New token i (position P + i) sees ring index j iff j < P and stored(j) > P + i - window,
        and new token k iff k <= i and i - k < window (HF's sliding-window overlay: a key is
        visible iff kv_idx > q_idx - window)."""
        g = self.g
        cos4, sin4 = position_angles(g, self.names.position_ids, spec.cos_table, spec.sin_table, "ring.rope")
        ring_len = g.ints(spec.ring_len)
        attend = g.op("Min", [self.attend, ring_len], "ring.attend_len")  # [1] A_r = min(A, R)
        indices = g.op(
            "Slice",
            [
                g.const("ring.all_indices", np.arange(spec.ring_len, dtype=np.int64)[None, :]),
                g.ints(0),
                attend,
                g.ints(1),
            ],
            "ring.indices",
        )  # [1, A_r]
        last = g.op("Sub", [lengths, g.ints(1)], "ring.last")  # [b, 1] P - 1
        back = g.op("Mod", [g.op("Sub", [last, indices], "ring.behind"), ring_len], "ring.back", fmod=0)
        stored = g.op("Sub", [last, back], "ring.stored")  # [b, A_r] position held at each ring index
        # visible iff i < stored + window - P (i: the new token's index in the call)
        reach = g.op(
            "Sub", [g.op("Add", [stored, g.ints(spec.window)], "ring.stored_w"), lengths], "ring.reach"
        )  # [b, A_r]
        in_window = g.op(
            "Less",
            [
                g.op("Unsqueeze", [new_idx, g.ints(0, 2)], "ring.i3"),  # [1, s, 1]
                g.op("Unsqueeze", [reach, g.ints(1)], "ring.reach3"),  # [b, 1, A_r]
            ],
            "ring.in_window",
        )  # [b, s, A_r]
        held = g.op("Unsqueeze", [g.op("Less", [indices, lengths], "ring.held"), g.ints(1)], "ring.held3")
        past_ok = g.op("And", [in_window, held], "ring.past_ok")  # [b, s, A_r]
        past_bias = g.op("Where", [past_ok, self.zero_f, self.neg_inf], "ring.past_bias")
        cols = g.op("Unsqueeze", [new_idx, g.ints(0)], "ring.cols")  # [1, s]
        distance = g.op("Sub", [rows, cols], "ring.distance")  # [s, s] i - k
        new_ok = g.op(
            "And",
            [
                g.op("LessOrEqual", [cols, rows], "ring.causal"),
                g.op("Less", [distance, g.ints(spec.window)], "ring.near"),
            ],
            "ring.new_ok",
        )
        new_bias = g.op("Where", [new_ok, self.zero_f, self.neg_inf], "ring.new_bias")  # [s, s]
        new_shape = g.op("Concat", [b_dim, s_dim, s_dim], "ring.new_shape", axis=0)
        mask3 = g.op(
            "Concat",
            [past_bias, g.op("Expand", [new_bias, new_shape], "ring.new_full")],
            "ring.mask3",
            axis=-1,
        )  # [b, s, A_r+s]
        mask4 = g.op("Unsqueeze", [mask3, g.ints(1)], "ring.mask4")  # [b, 1, s, A_r+s]
        return RingInputs(
            cos4=cos4,
            sin4=sin4,
            attend=attend,
            mask=g.op("Tile", [mask4, g.ints(1, 1, groups, 1)], "ring.mask"),  # [b, 1, g*s, A_r+s]
            split_as=g.op("Concat", [attend, s_dim], "ring.split_as", axis=0),
            codec=Int8Codec(g, self.kv_heads, spec.head_dim or self.d, kv_group_size, attend, "ring.int8")
            if kv_group_size
            else None,
            d=spec.head_dim or self.d,
        )

    def rope(self, x: str, name: str, rotate: bool = True, local: bool = False) -> str:
        """x [b, n, s, d] rotated by the positions' angles (HF rotate_half convention), with the
        ring layers' own tables where `ring`."""
        g = self.g
        if not rotate:  # a layer without RoPE: x itself, under the name the caller wants
            return g.op("Identity", [x], name)
        cos4, sin4 = (self.ring.cos4, self.ring.sin4) if local else (self.cos4, self.sin4)
        d = self.ring.d if local else self.d
        return rotate_half(g, x, cos4, sin4, g.ints(d // 2, d // 2), name)

    def softmax(self, scores: str, mask: str, p: str) -> str:
        """softmax(scores + mask) over the keys, in float32: the mask is float32 (-inf) and, over a
        float16 cache, the scores are widened for it and the probabilities narrowed after."""
        g = self.g
        if self.half:
            scores = g.op("Cast", [scores], f"{p}.scores32", to=TensorProto.FLOAT)
        masked = g.op("Add", [scores, mask], f"{p}.masked")
        probs = g.op("Softmax", [masked], f"{p}.probs32" if self.half else f"{p}.probs", axis=-1)
        return g.op("Cast", [probs], f"{p}.probs", to=TensorProto.FLOAT16) if self.half else probs

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        """Layer i's attention; a sliding-window layer (`local`) reads its ring through the ring mask."""
        g, names, p = self.g, self.names, f"model.layers.{i}"
        inputs = self.ring if local else self
        heads, kvh, d = self.heads, self.kv_heads, inputs.d
        q, k, v = g.op(
            "Split", [qkv, g.ints(heads * d, kvh * d, kvh * d)], f"{p}.attn.qkv_parts", outputs=3, axis=-1
        )
        k = g.op(
            "Transpose",
            [g.op("Reshape", [k, g.ints(0, 0, kvh, d)], f"{p}.attn.k4")],
            f"{p}.attn.k_bhsd",
            perm=[0, 2, 1, 3],
        )
        codec = inputs.codec
        v = g.op(
            "Transpose",
            [g.op("Reshape", [v, g.ints(0, 0, kvh, d)], f"{p}.attn.v4")],
            f"{p}.attn.v_new" if codec else names.layer(names.present_value, i),
            perm=[0, 2, 1, 3],
        )
        k = self.rope(
            k, f"{p}.attn.k_new" if codec else names.layer(names.present_key, i), rotate, local
        )  # [b, kvh, s, d]
        past = [names.layer(t, i) for t in names.past(codec is not None)]
        if codec:  # the new tokens attend over exactly what the cache will hold
            k, v = codec.write(k, v, [names.layer(t, i) for t in names.present(True)], f"{p}.attn.int8")
        else:
            past = [
                g.op("Slice", [name, g.ints(0), inputs.attend, g.ints(2)], f"{p}.attn.past{n}")
                for n, name in enumerate(past)
            ]  # K, V [b, kvh, A, d]
        self.read[i] = LayerKV(k, v, tuple(past))
        return self.attend_over(p, q, self.read[i], rotate, local)

    def shared(self, i: int, layer: int, q: str, local: bool = False) -> str:
        """Model layer `layer`'s attention over the KV that KV layer i's attention read (Gemma 4's
        shared layers: queries of their own, no K or V)."""
        return self.attend_over(f"model.layers.{layer}", q, self.read[i], True, local)

    def attend_over(self, p: str, q: str, kv: LayerKV, rotate: bool, local: bool) -> str:
        """softmax(q K^T + mask) V of queries q [b, s, heads*d] over `kv`: [b, s, heads*d]."""
        g = self.g
        inputs = self.ring if local else self
        heads, kvh, d = self.heads, self.kv_heads, inputs.d
        q = g.op(
            "Transpose",
            [g.op("Reshape", [q, g.ints(0, 0, heads, d)], f"{p}.attn.q5")],
            f"{p}.attn.q_bhsd",
            perm=[0, 2, 1, 3],
        )
        q = g.op(
            "Reshape",
            [self.rope(q, f"{p}.attn.q_rope", rotate, local), g.ints(0, kvh, -1, d)],
            f"{p}.attn.q_grouped",
        )  # [b, kvh, g*s, d]
        codec, past = inputs.codec, kv.past
        if codec:
            past_scores = codec.past_scores(q, past[0], past[2], f"{p}.attn.past_k")
        else:
            past_scores = g.op(
                "MatMul",
                [q, g.op("Transpose", [past[0]], f"{p}.attn.past_kT", perm=[0, 1, 3, 2])],
                f"{p}.attn.past_scores",
            )  # [b, kvh, g*s, A]
        scores = g.op(
            "Concat",
            [
                past_scores,
                g.op(
                    "MatMul",
                    [q, g.op("Transpose", [kv.k], f"{p}.attn.new_kT", perm=[0, 1, 3, 2])],
                    f"{p}.attn.new_scores",
                ),
            ],
            f"{p}.attn.scores",
            axis=-1,
        )
        probs = self.softmax(scores, inputs.mask, f"{p}.attn")
        p_past, p_new = g.op("Split", [probs, inputs.split_as], f"{p}.attn.probs_parts", outputs=2, axis=-1)
        if codec:
            from_past = codec.past_context(p_past, past[1], past[3], f"{p}.attn.past_v")
        else:
            from_past = g.op("MatMul", [p_past, past[1]], f"{p}.attn.from_past")
        attn = g.op(
            "Add",
            [
                from_past,
                g.op("MatMul", [p_new, kv.v], f"{p}.attn.from_new"),
            ],
            f"{p}.attn.context",
        )  # [b, kvh, g*s, d]
        return g.merged_heads(attn, heads, d, f"{p}.attn")  # [b, s, heads*d]
