"""Memory planner: does a model with S cache slots of C tokens fit in a byte budget?

The estimate, per (slots, context, kv dtype)::

    total = weights + load + kv + states + activations + runtime    (mapped: beside it)

weights      export folder: bytes of model.onnx (+ model.onnx.data). Recipe: what `kvedge export`
             writes for the weight form (`ExportRecipe`: --weights, --variant, --block-size,
             --outlier-channels, --head-bits, --decode-matmuls). float32/float16: param_count x 4/2.
             int8/int4 (`kvedge/export/quantize.py`, `graph.py`): each projection [K, N] (fused
             QKV, O, fused gate/up, down, and the LM head at its head bits) stores its codes
             (K N bits/8), a float scale per block of `block_size` rows (K/bs x N), the second
             product's rows (block offsets, assumed present, + the kept channels: (K/bs + kept) x
             N floats) and its side inputs (the kept indices; portable: and the [K] mask);
             with `--variant ort` and kvedge's decode matmuls the graph holds
             the decode form too: the codes again with float16 scales and minimums
             and float16 kept rows. A tied embedding table is the head's blocks (the runtime
             looks rows up there); an untied one is 8-bit codes with a float scale and offset
             per block (embeddings.bin); everything else (norms, biases) is param_count less
             the projections, the head and the table, 4 bytes each (2 in a float16 graph).
             Checked against real exports: a random 2-layer llama
             (tests/test_planner.py, five forms) 0.8-2.2% (35-52 KiB) under the files, the
             graph's own bytes and RoPE tables not counted; SmolLM2-135M `--weights int8
             --outlier-channels 0`: planned 294,107,904, files 291,490,818 (+0.9%: its Q8_0 LM
             head needs no block offsets, 3.5 MB the planner assumes).
load         what the backend holds beyond the weight bytes. onnxruntime CPU, measured per form
             (`CPU_HELD`: bytes held once loaded and stepped, as a multiple of the weight files):
             float32 weights 1.3 (MLAS's prepacked copy replaces the file's pages, plus padding);
             float16 weights 2.6 in a float32 graph (its Casts are folded to a float32 copy at
             load, then prepacked) and 2.45 in a float16 graph (no float16 kernels on x86: the
             same widening); int8 / int4 weights 1.8 / 2.05, 2.0 / 2.4 in a float16 graph (the
             MatMulNBits kernels' packed blocks beside the graph's; an ort export with one form
             of its weights or two alike). Measured with onnxruntime
             1.2x on SmolLM2-135M (peak RSS of a fresh process after load and two decode steps,
             less the tokenizer, which `runtime` counts, and the KV pool; every form within 10%:
             tests/test_real_model.py); a larger model's fixed parts weigh less, so these
             over-count it. GPU backends (onnxruntime CUDA, TensorRT): 1.0 x weights,
             ASSUMED (not measured): on unified memory the host copy read from disk and the
             device copy coexist while the model loads (TensorRT reads the engine memory-mapped,
             `backends.trt.deserialize_engine`: page cache the kernel can drop, kept in the term
             until device_tests/memory.py measures it); plus a float32 graph's float32 copy of
             float16-stored weights (`widened_bytes`, 2 x the file: onnxruntime folds the Casts).
kv           `CacheGeometry(max_len=C, dtype=kv).bytes_held(C) x S`: the KV `KVCache` allocates
             (tests/test_planner.py checks it). A quantized cache's scales belong to
             CacheGeometry and appear here with no change to this module. A hybrid model's KV
             covers its attention layers only (`kv_layers`). The runtime's token record (8 bytes
             per cached token) is not cache geometry and sits in the margin of `runtime`.
states       a hybrid model's per-slot states (`CacheGeometry.states`: LFM2's convolution, Qwen3.5's
             Gated DeltaNet layers), fixed whatever the context: S x `state_bytes_per_slot()` x
             (1 + MAX_SNAPSHOTS), the pool `KVCache` allocates plus the snapshots it keeps of each
             slot's states where a later turn may resume (at most MAX_SNAPSHOTS each,
             `KVCache.snapshot`). 0 for other models.
activations  the largest single call: one sequence prefilling a chunk of s = PREFILL_CHUNK tokens,
             or one decode step for all S slots. It is dominated by the attention scores of one
             layer, [kv_heads, g*s, C+s] float32 (the graph never copies the cache). Measured
             with onnxruntime 1.32 CPU, SmolLM2-135M, chunk 256, C = 2048: peak 76-152 MiB
             (arena growth depends on call order), i.e. up to 7.5 score-sized buffers; the
             estimate counts 8, plus 3 MLP-sized and 4 hidden-sized buffers, the logits, and
             the new tokens' K/V twice (the graph's output and the runtime's copy of it); a hybrid's
             present states likewise, per row (not measured; a Gated DeltaNet chunk's own [v heads,
             s, s] buffers, 32 MiB at 256 tokens for 32 heads, are not counted).
mapped       Gemma 4's per-layer embedding table (`PerLayerTable`): a file of its own, float16
             (float32 beside float32 weights), that the runtime maps read-only and reads one row of
             per token. Its pages are page cache the kernel may drop under pressure, never the
             backend's memory, so the estimate shows it on its own line and leaves it out of the
             total: what competes with the KV cache is the rest (docs/PERFORMANCE.md, "Gemma 4:
             shared KV and the per-layer table").
runtime      Python + numpy + onnxruntime + tokenizer: 96 MiB (measured 70-75 MiB). A GPU
             backend adds the CUDA context and libraries (cuBLAS, cuDNN or TensorRT): 1 GiB,
             ASSUMED, not measured (no GPU was available when this was written); device_tests
             is where it gets measured.

Checked (cpu preset): SmolLM2-135M float32, max_len 2048, 1/2/4/8 slots each prefilled with 600
tokens then decoding: measured peak RSS 1078/1178/1424/1718 MiB, planned 1045/1135/1315/1675
(3-8% under: the load term, 1.3 x weights, is measured after two decode steps, not 600-token
prefills, whose arena growth the activations term counts at 8 score buffers).

What fits instead: when no cell of a plan fits, `what_fits` offers the smallest change that
makes its smallest cell (fewest slots, shortest context) fit. It weighs fewer slots; every other
form of a recipe that `kvedge export` makes and the chosen `--device` runs (variant, precision,
weights, head bits, cache dtype: `device_forms`; an export's other cache dtypes, a re-export);
a shorter --max-len, alone and with each form. A change must save bytes at that cell and never
make the weights (with what loading them holds) or the cache's bytes per token bigger. The
longest context first (a shorter one changes what the model can do most), then a KL within the
bar (`quality_tier`), then the fewest bytes saved, then the fewest options. A form the device
refuses (`kvedge.contract.engine.device_refusal`, the runtime's rule) gets no table and no smallest
change: one line saying why, and the nearest form it runs (`nearest_runnable`).

What to run: `recommend` gives one form per budget (a board profile) and GPU device (cuda,
tensorrt; `RECOMMENDED_DEVICES` says why not the CPU), the form `kvedge plan` prints last and
the README and docs/JETSON.md state per board: of the forms the device runs whose KL against the
float32 model was measured (`WEIGHTS_KL`, `PRECISION_KL`, `CACHE_KL`, summed over a form's
choices) within `QUALITY_BAR`, the one holding the most slots at the recipe's max_len; ties to
the fewer bytes, then the lower KL. That KLs of separate choices add is an approximation the
bench supports: ort int8 weights 0.0009 + the INT8 cache 0.0003 = 0.0012, measured together 0.0013.

Budgets: a board profile's `memory_bytes` minus a reserve for the kernel, carveouts and the OS
(1.5 GiB by default, an estimate for a headless L4T; a desktop session needs about 1 GiB
more), or what this process may allocate on the live machine (`live_budget`: MemAvailable from
/proc/meminfo, or a container's cgroup limit or a ulimit where lower). On Jetson's unified memory
MemAvailable is the right figure, not cudaMemGetInfo (NVIDIA's "CUDA for Tegra" app note, "Estimating Total
Allocatable Device Memory on an Integrated GPU Device").
"""

from kvedge.planner.budget import Budget, board_budget, live_budget, parse_bytes
from kvedge.planner.estimate import (
    CPU_HELD,
    OVERHEADS,
    SECOND_FORM_DECODE_GAIN,
    Estimate,
    ModelFootprint,
    check_fits,
    estimate,
    footprint,
    kv_bytes,
    state_bytes,
    with_form,
)
from kvedge.planner.recommend import (
    CACHE_KL,
    MAX_SLOTS,
    PRECISION_KL,
    QUALITY_BAR,
    RECOMMENDED_DEVICES,
    WEIGHTS_KL,
    device_forms,
    measured_kl,
    model_refusal,
    recommend,
)
from kvedge.planner.render import make_plan, render
from kvedge.planner.report import plan_report, weight_form
from kvedge.planner.search import nearest_runnable, quality_tier, what_fits
from kvedge.planner.weights import recipe_weight_bytes, widened_bytes

__all__ = [
    "CACHE_KL",
    "CPU_HELD",
    "MAX_SLOTS",
    "OVERHEADS",
    "PRECISION_KL",
    "QUALITY_BAR",
    "RECOMMENDED_DEVICES",
    "SECOND_FORM_DECODE_GAIN",
    "WEIGHTS_KL",
    "Budget",
    "Estimate",
    "ModelFootprint",
    "board_budget",
    "check_fits",
    "device_forms",
    "estimate",
    "footprint",
    "kv_bytes",
    "live_budget",
    "make_plan",
    "measured_kl",
    "model_refusal",
    "nearest_runnable",
    "parse_bytes",
    "plan_report",
    "quality_tier",
    "recipe_weight_bytes",
    "recommend",
    "render",
    "state_bytes",
    "weight_form",
    "what_fits",
    "widened_bytes",
    "with_form",
]
