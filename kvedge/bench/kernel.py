"""One attention layer alone: kvedge's cache attentions against GroupQueryAttention (figures for docs).

    python bench/kernel.py [--contexts 64 512 1536] [--prefill 128 512 1024 2048] [--threads 1]
                           [--rounds 3] [--runs 300] [--prefill-runs 5] [--int4]

SmolLM2-135M's attention shapes by default (9 query / 3 KV heads, head_dim 64, max_len 2048,
32-channel scale groups): kvedge.Int8CacheAttention over an INT8 cache and onnxruntime's
GroupQueryAttention over a float32 cache, each a one-node graph in its own session, caches bound
in place by I/O binding; with --int4, kvedge.Int4CacheAttention too (5-bit keys, a float window
of 32 in a ring of 64: tests/test_kv4.py's layer). Decode: one new token after `ctx` cached ones
(--runs calls). Prefill: a fresh prompt of P tokens in one call (--prefill-runs calls; the
kernels' tiled path). The systems alternate within each of --rounds rounds, the order flipping
per round, all in one process. Prints microseconds per call (median over rounds of each round's
mean after warm-up calls) and the INT8 kernel's speed-up over GroupQueryAttention (median of the
per-round ratios); with --int4, also the int4 kernel's time over the INT8 kernel's (likewise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from kvedge import kv4
from kvedge.contract import INT4_ATTENTION_OP, INT8_ATTENTION_OP, KVEDGE_OPS_DOMAIN
from kvedge.runtime import kernels

KERNEL = "kvedge.Int8CacheAttention (INT8 cache)"
GQA = "GroupQueryAttention (float32 cache)"
INT4 = "kvedge.Int4CacheAttention (4-bit cache)"
INT4_KEY_BITS, INT4_WINDOW, INT4_RING = 5, 32, 64


INT4_INPUTS = {  # kvedge.Int4CacheAttention's inputs, in order, and their element types
    "qkv": TensorProto.FLOAT,
    "lengths": TensorProto.INT64,
    "kc": TensorProto.UINT8,
    "ks": TensorProto.FLOAT16,
    "vc": TensorProto.UINT8,
    "vs": TensorProto.FLOAT16,
    "kw": TensorProto.FLOAT,
    "vw": TensorProto.FLOAT,
    "cos": TensorProto.FLOAT,
    "sin": TensorProto.FLOAT,
}


def int4_session(
    heads: int,
    kv_heads: int,
    key_bits: int,
    window: int,
    threads: int,
    dims: dict[str, list] | None = None,
    out_dims: list | None = None,
    **attributes: int,
) -> ort.InferenceSession:
    """One kvedge.Int4CacheAttention node in its own session: inputs named as INT4_INPUTS (of
    `dims`, where given), outputs "out" and each state input's name + "_out"."""
    dims = dims or {}
    inputs = [helper.make_tensor_value_info(n, e, dims.get(n)) for n, e in INT4_INPUTS.items()]
    state = list(INT4_INPUTS)[2:8]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_dims)]
    outputs += [helper.make_tensor_value_info(n + "_out", INT4_INPUTS[n], dims.get(n)) for n in state]
    node = helper.make_node(
        INT4_ATTENTION_OP,
        list(INT4_INPUTS),
        [o.name for o in outputs],
        domain=KVEDGE_OPS_DOMAIN,
        num_heads=heads,
        kv_num_heads=kv_heads,
        key_bits=key_bits,
        window=window,
        **attributes,
    )
    return one_node_session(node, inputs, outputs, KVEDGE_OPS_DOMAIN, threads)


def one_node_session(node, inputs, outputs, domain: str, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph([node], "layer", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    )
    # export's IR version for opset 17 (kvedge/export/graph/): onnx's default is its own newest
    # (14 for onnx 1.23), which onnxruntime 1.23 (the newest with Python 3.10 wheels) refuses
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(kernels.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def bound(session: ort.InferenceSession, arrays: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
    binding = session.io_binding()
    for name, array in arrays.items():
        binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    for name, array in outputs.items():
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    return binding


class Layer:
    """The one-node sessions and their caches, for calls of any number of new tokens."""

    def __init__(
        self, h: int, kvh: int, d: int, length: int, group_size: int, threads: int, int4: bool = False
    ) -> None:
        self.h, self.kvh, self.d = h, kvh, d
        width, groups = (h + 2 * kvh) * d, d // group_size
        cache, scales = [1, kvh, length, d], [1, kvh, length, groups]
        qkv_info = helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "seq", width])
        out_info = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "seq", h * d])

        def info(name: str, elem: int, shape: list) -> object:
            return helper.make_tensor_value_info(name, elem, shape)

        self.int8 = one_node_session(
            helper.make_node(
                INT8_ATTENTION_OP,
                ["qkv", "lengths", "k", "v", "ks", "vs", "cos", "sin"],
                ["out", "k_out", "v_out", "ks_out", "vs_out"],
                domain=KVEDGE_OPS_DOMAIN,
                num_heads=h,
                kv_num_heads=kvh,
            ),
            [qkv_info, info("lengths", TensorProto.INT64, [1])]
            + [info(n, TensorProto.INT8, cache) for n in ("k", "v")]
            + [info(n, TensorProto.FLOAT16, scales) for n in ("ks", "vs")]
            + [info(n, TensorProto.FLOAT, [length, d // 2]) for n in ("cos", "sin")],
            [out_info]
            + [info(n, TensorProto.INT8, cache) for n in ("k_out", "v_out")]
            + [info(n, TensorProto.FLOAT16, scales) for n in ("ks_out", "vs_out")],
            KVEDGE_OPS_DOMAIN,
            threads,
        )
        self.gqa = one_node_session(
            helper.make_node(
                "GroupQueryAttention",
                ["qkv", "", "", "k", "v", "seqlens", "total", "cos", "sin"],
                ["out", "k_out", "v_out"],
                domain="com.microsoft",
                num_heads=h,
                kv_num_heads=kvh,
                scale=1.0,
                do_rotary=1,
            ),
            [qkv_info]
            + [info(n, TensorProto.FLOAT, cache) for n in ("k", "v")]
            + [info("seqlens", TensorProto.INT32, [1]), info("total", TensorProto.INT32, [])]
            + [info(n, TensorProto.FLOAT, [length, d // 2]) for n in ("cos", "sin")],
            [out_info] + [info(n, TensorProto.FLOAT, cache) for n in ("k_out", "v_out")],
            "com.microsoft",
            threads,
        )
        rng = np.random.default_rng(0)
        self.rng = rng
        angles = np.arange(length)[:, None] * 10000.0 ** (-np.arange(d // 2) / (d // 2))
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        self.codes = {n: rng.integers(-127, 128, cache).astype(np.int8) for n in ("k", "v")}
        self.factors = {n: np.full(scales, 0.01, np.float16) for n in ("ks", "vs")}
        self.floats = {n: rng.standard_normal(cache).astype(np.float32) for n in ("k", "v")}
        self.int4 = self.int4_session(length, threads) if int4 else None

    def int4_session(self, length: int, threads: int) -> ort.InferenceSession:
        """The int4 kernel's session and its state (random codes, scales and ring rows)."""
        h, kvh, d, rng = self.h, self.kvh, self.d, self.rng
        shapes = {
            "kc": (TensorProto.UINT8, [1, kvh, length, kv4.row_bytes(d, INT4_KEY_BITS)]),
            "ks": (TensorProto.FLOAT16, [1, kvh, length, kv4.key_groups(d, INT4_KEY_BITS)]),
            "vc": (TensorProto.UINT8, [1, kvh, length, kv4.row_bytes(d, 4)]),
            "vs": (TensorProto.FLOAT16, [1, kvh, length, 1]),
            "kw": (TensorProto.FLOAT, [1, kvh, INT4_RING, d]),
            "vw": (TensorProto.FLOAT, [1, kvh, INT4_RING, d]),
        }
        self.state4 = {}
        for name, (elem, shape) in shapes.items():
            if elem == TensorProto.UINT8:
                self.state4[name] = rng.integers(0, 256, shape).astype(np.uint8)
            elif elem == TensorProto.FLOAT16:
                self.state4[name] = np.full(shape, 0.1, np.float16)
            else:
                self.state4[name] = rng.standard_normal(shape).astype(np.float32)
        width = (h + 2 * kvh) * d
        dims = {"qkv": [1, "seq", width], "lengths": [1], "cos": [length, d // 2], "sin": [length, d // 2]}
        dims.update({n: shape for n, (_, shape) in shapes.items()})
        return int4_session(h, kvh, INT4_KEY_BITS, INT4_WINDOW, threads, dims, [1, "seq", h * d])

    def calls(self, past: int, new: int) -> dict[str, tuple[ort.InferenceSession, object, list]]:
        """Each system bound for `new` tokens after `past` cached ones: name -> (session, binding, kept)."""
        qkv = self.rng.standard_normal((1, new, (self.h + 2 * self.kvh) * self.d), np.float32)
        out = np.zeros((1, new, self.h * self.d), np.float32)
        lengths = np.array([past], np.int64)
        seqlens, total = np.array([past + new - 1], np.int32), np.array(past + new, np.int32)
        rope = {"cos": self.cos, "sin": self.sin}
        kernel_in = {"qkv": qkv, "lengths": lengths, **self.codes, **self.factors, **rope}
        kernel_out = {"out": out, "k_out": self.codes["k"], "v_out": self.codes["v"]}
        kernel_out |= {"ks_out": self.factors["ks"], "vs_out": self.factors["vs"]}
        gqa_in = {"qkv": qkv, **self.floats, "seqlens": seqlens, "total": total, **rope}
        gqa_out = {"out": out, "k_out": self.floats["k"], "v_out": self.floats["v"]}
        kept = [qkv, out, lengths, seqlens, total]  # the bound buffers must outlive the bindings
        calls = {
            KERNEL: (self.int8, bound(self.int8, kernel_in, kernel_out), kept),
            GQA: (self.gqa, bound(self.gqa, gqa_in, gqa_out), kept),
        }
        if self.int4 is not None:
            int4_in = {"qkv": qkv, "lengths": lengths, **self.state4, **rope}
            int4_out = {"out": out} | {n + "_out": a for n, a in self.state4.items()}
            calls[INT4] = (self.int4, bound(self.int4, int4_in, int4_out), kept)
        return calls


def time_calls(session: ort.InferenceSession, binding, runs: int, warmup: int) -> float:
    """Mean microseconds per call."""
    for _ in range(warmup):
        session.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(runs):
        session.run_with_iobinding(binding)
    return (time.perf_counter() - start) / runs * 1e6


def compare(layer: Layer, past: int, new: int, rounds: int, runs: int, warmup: int) -> str:
    calls = layer.calls(past, new)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds):
        for name in list(calls)[:: 1 if round_ % 2 == 0 else -1]:
            session, binding, _ = calls[name]
            times[name].append(time_calls(session, binding, runs, warmup))
    speedup = statistics.median(g / k for k, g in zip(times[KERNEL], times[GQA], strict=True))
    figures = ", ".join(f"{name} {statistics.median(t):.1f} us" for name, t in times.items())
    line = f"{figures}; kernel {speedup:.2f}x"
    if INT4 in times:
        ratio = statistics.median(f / k for k, f in zip(times[KERNEL], times[INT4], strict=True))
        line += f"; int4 / int8 time {ratio:.2f}"
    return line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="*", default=[64, 512, 1536])
    parser.add_argument("--prefill", type=int, nargs="*", default=[128, 512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--prefill-runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--int4", action="store_true", help="time kvedge.Int4CacheAttention too")
    args = parser.parse_args(argv)
    layer = Layer(
        args.heads, args.kv_heads, args.head_dim, args.max_len, args.group_size, args.threads, args.int4
    )
    shape = f"{args.heads} query / {args.kv_heads} KV heads, head_dim {args.head_dim}, max_len {args.max_len}"
    print(f"one layer: {shape}, {args.threads} thread(s), {args.rounds} rounds")
    for ctx in args.contexts:
        print(f"decode ctx {ctx}: " + compare(layer, ctx, 1, args.rounds, args.runs, 20), flush=True)
    for tokens in args.prefill:
        print(
            f"prefill {tokens}: " + compare(layer, 0, tokens, args.rounds, args.prefill_runs, 1), flush=True
        )
