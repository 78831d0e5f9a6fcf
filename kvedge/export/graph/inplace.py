"""The ort variant's in-place attentions: onnxruntime's GroupQueryAttention, and kvedge's
Int8CacheAttention kernel over the INT8 cache; past and present share one buffer.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kvedge.contract import INT8_ATTENTION_OP, KVEDGE_OPS_DOMAIN, VERIFY_TOKENS
from kvedge.export.graph.options import MS_DOMAIN


class InPlaceAttention:
    """What the in-place attentions share: the heads, the RoPE tables (cos, sin [L, d/2]) and, for
    sliding-window layers (Gemma 3), their own tables and a window over the full-length cache."""

    def __init__(
        self, g, heads, kv_heads, names, cos_table, sin_table, local_cos=None, local_sin=None, window=0
    ) -> None:
        self.g, self.names, self.heads, self.kv_heads = g, names, heads, kv_heads
        self.cos_table, self.sin_table = cos_table, sin_table
        self.local_cos, self.local_sin, self.window = local_cos, local_sin, window


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
        super().__init__(g, heads, kv_heads, names, **tables)
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
        super().__init__(g, heads, kv_heads, names, **tables)
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
