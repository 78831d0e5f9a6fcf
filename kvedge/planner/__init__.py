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
             The graph's own bytes and RoPE tables are not counted. Checked against real
             exports (a random 2-layer llama's five forms in tests/test_planner.py, and
             SmolLM2-135M): docs/PERFORMANCE.md, "The memory planner's terms".
load         what the backend holds beyond the weight bytes. onnxruntime CPU: `CPU_HELD`, bytes
             held once loaded and stepped as a multiple of the weight files, per graph precision
             and weights. MLAS's prepacked copy replaces a float32 file's pages (plus padding);
             float16 weights are widened at load (their Casts folded to a float32 copy, then
             prepacked), in a float16 graph too (no float16 kernels on x86); int8 / int4 weights
             add the MatMulNBits kernels' packed blocks beside the graph's (an ort export with one
             form of its weights or two alike). Each factor is a peak RSS of SmolLM2-135M in a
             fresh process after load and two decode steps, less the tokenizer (which `runtime`
             counts) and the KV pool (docs/PERFORMANCE.md, "The memory planner's terms";
             tests/test_real_model.py holds every form to it); a larger model's fixed parts weigh
             less, so these over-count it. GPU backends (onnxruntime CUDA, TensorRT): 1.0 x weights,
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
             layer, [kv_heads, g*s, C+s] float32 (the graph never copies the cache). The
             estimate counts 8 score-sized buffers, over the most onnxruntime's CPU arena was seen
             to hold (its growth depends on call order; docs/PERFORMANCE.md, "The memory
             planner's terms"), plus 3 MLP-sized and 4 hidden-sized buffers, the logits, and
             the new tokens' K/V twice (the graph's output and the runtime's copy of it); a hybrid's
             present states likewise, per row (not measured; a Gated DeltaNet chunk's own [v heads,
             s, s] buffers, 32 MiB at 256 tokens for 32 heads, are not counted).
mapped       Gemma 4's per-layer embedding table (`PerLayerTable`): a file of its own, float16
             (float32 beside float32 weights), that the runtime maps read-only and reads one row of
             per token. Its pages are page cache the kernel may drop under pressure, never the
             backend's memory, so the estimate shows it on its own line and leaves it out of the
             total: what competes with the KV cache is the rest (docs/PERFORMANCE.md, "Gemma 4:
             shared KV and the per-layer table").
runtime      Python + numpy + onnxruntime + tokenizer: 96 MiB, over what a CPU process holds
             (docs/PERFORMANCE.md, "The memory planner's terms"). A GPU
             backend adds the CUDA context and libraries (cuBLAS, cuDNN or TensorRT): 1 GiB,
             ASSUMED, not measured (no GPU was available when this was written); device_tests
             is where it gets measured.

The whole estimate against runs (cpu preset, SmolLM2-135M float32, 1 to 8 slots):
docs/PERFORMANCE.md, "The memory planner's terms". It plans a little under runs that prefill
hundreds of tokens: the load factors were taken after two decode steps, and the activations term
counts a prefill's arena growth at 8 score buffers only.

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
bench supports (docs/PERFORMANCE.md, "Quality of each export choice").

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
