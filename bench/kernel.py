"""One attention layer alone: kvedge.Int8CacheAttention against GroupQueryAttention (figures for docs).

    python bench/kernel.py [--contexts 64 512 1536] [--runs 300] [--threads 1]

Decode (one new token), SmolLM2-135M's attention shapes by default (9 query / 3 KV heads,
head_dim 64, max_len 2048, 32-channel scale groups): kvedge's kernel over an INT8 cache and
onnxruntime's GroupQueryAttention over a float32 cache, each a one-node graph in its own
session, caches bound in place by I/O binding, the two alternating per context in one process.
Prints microseconds per call (mean over --runs after 20 warm-up calls).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from kvedge.contract import INT8_ATTENTION_OP, KVEDGE_OPS_DOMAIN
from kvedge.runtime import kernels


def one_node_session(node, inputs, outputs, domain: str, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph([node], "layer", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    )
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 1536])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args()
    h, kvh, d, length = args.heads, args.kv_heads, args.head_dim, args.max_len
    groups = d // args.group_size
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, 1, (h + 2 * kvh) * d), np.float32)
    angles = np.arange(length)[:, None] * 10000.0 ** (-np.arange(d // 2) / (d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def info(name: str, elem: int, shape: list) -> object:
        return helper.make_tensor_value_info(name, elem, shape)

    cache, scales = [1, kvh, length, d], [1, kvh, length, groups]
    int8 = one_node_session(
        helper.make_node(
            INT8_ATTENTION_OP,
            ["qkv", "lengths", "k", "v", "ks", "vs", "cos", "sin"],
            ["out", "k_out", "v_out", "ks_out", "vs_out"],
            domain=KVEDGE_OPS_DOMAIN,
            num_heads=h,
            kv_num_heads=kvh,
        ),
        [info("qkv", TensorProto.FLOAT, list(qkv.shape)), info("lengths", TensorProto.INT64, [1])]
        + [info(n, TensorProto.INT8, cache) for n in ("k", "v")]
        + [info(n, TensorProto.FLOAT16, scales) for n in ("ks", "vs")]
        + [info(n, TensorProto.FLOAT, [length, d // 2]) for n in ("cos", "sin")],
        [info("out", TensorProto.FLOAT, [1, 1, h * d])]
        + [info(n, TensorProto.INT8, cache) for n in ("k_out", "v_out")]
        + [info(n, TensorProto.FLOAT16, scales) for n in ("ks_out", "vs_out")],
        KVEDGE_OPS_DOMAIN,
        args.threads,
    )
    gqa = one_node_session(
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
        [info("qkv", TensorProto.FLOAT, list(qkv.shape))]
        + [info(n, TensorProto.FLOAT, cache) for n in ("k", "v")]
        + [info("seqlens", TensorProto.INT32, [1]), info("total", TensorProto.INT32, [])]
        + [info(n, TensorProto.FLOAT, [length, d // 2]) for n in ("cos", "sin")],
        [info("out", TensorProto.FLOAT, [1, 1, h * d])]
        + [info(n, TensorProto.FLOAT, cache) for n in ("k_out", "v_out")],
        "com.microsoft",
        args.threads,
    )
    codes = {n: rng.integers(-127, 128, cache).astype(np.int8) for n in ("k", "v")}
    factors = {n: np.full(scales, 0.01, np.float16) for n in ("ks", "vs")}
    floats = {n: rng.standard_normal(cache).astype(np.float32) for n in ("k", "v")}
    out = np.zeros((1, 1, h * d), np.float32)
    shape = f"{h} query / {kvh} KV heads, head_dim {d}, max_len {length}"
    print(f"one layer, decode: {shape}, {args.threads} thread(s)")
    for ctx in args.contexts:
        lengths = np.array([ctx], np.int64)
        runs = {
            "kvedge.Int8CacheAttention (INT8 cache)": (
                int8,
                bound(
                    int8,
                    {"qkv": qkv, "lengths": lengths, **codes, **factors, "cos": cos, "sin": sin},
                    {
                        "out": out,
                        "k_out": codes["k"],
                        "v_out": codes["v"],
                        "ks_out": factors["ks"],
                        "vs_out": factors["vs"],
                    },
                ),
            ),
            "GroupQueryAttention (float32 cache)": (
                gqa,
                bound(
                    gqa,
                    {
                        "qkv": qkv,
                        **floats,
                        "seqlens": np.array([ctx], np.int32),
                        "total": np.array(ctx + 1, np.int32),
                        "cos": cos,
                        "sin": sin,
                    },
                    {"out": out, "k_out": floats["k"], "v_out": floats["v"]},
                ),
            ),
        }
        line = []
        for name, (session, binding) in runs.items():
            for _ in range(20):
                session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(args.runs):
                session.run_with_iobinding(binding)
            line.append(f"{name} {(time.perf_counter() - start) / args.runs * 1e6:.1f} us")
        print(f"ctx {ctx}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
