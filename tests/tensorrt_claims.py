"""Every export kvedge says TensorRT takes (`--variant portable`), one option set per line: the
parse-and-build test (test_tensorrt_acceptance.py, TensorRT for RTX) and the static check against
the oldest claimed TensorRT (test_tensorrt_oldest.py, no TensorRT needed) both read this."""

from __future__ import annotations

from kvedge.contract import ExportRecipe

MAX_LEN = 128
# --variant portable with these precisions, weights and cache dtypes (each --precision's allowed
# --weights times its allowed --kv-dtype, the int8 cache with int4 weights)
ACCEPTED = {
    "float32": ExportRecipe(max_len=MAX_LEN),
    "float16-weights": ExportRecipe(max_len=MAX_LEN, weights="float16"),
    "int8-weights": ExportRecipe(max_len=MAX_LEN, weights="int8"),
    "int4-weights": ExportRecipe(max_len=MAX_LEN, weights="int4"),
    "int4-weights-int4-head": ExportRecipe(max_len=MAX_LEN, weights="int4", head_bits=4),
    "int8-cache": ExportRecipe(max_len=MAX_LEN, kv_dtype="int8"),
    "int4-weights-int8-cache": ExportRecipe(max_len=MAX_LEN, weights="int4", kv_dtype="int8"),
    "float16-weights-int8-cache": ExportRecipe(max_len=MAX_LEN, weights="float16", kv_dtype="int8"),
    "float16-precision": ExportRecipe(max_len=MAX_LEN, precision="float16"),
    "float16-precision-int8-weights": ExportRecipe(max_len=MAX_LEN, precision="float16", weights="int8"),
    "float16-precision-int4-weights": ExportRecipe(max_len=MAX_LEN, precision="float16", weights="int4"),
    # no kept channel: the default over a GGUF's own blocks (`ExportRecipe.kept_channels_of`)
    "float16-precision-int4-weights-no-kept-channels": ExportRecipe(
        max_len=MAX_LEN, precision="float16", weights="int4", outlier_channels=0
    ),
    "float16-precision-int4-weights-int4-head": ExportRecipe(
        max_len=MAX_LEN, precision="float16", weights="int4", head_bits=4
    ),
    "float16-precision-int8-cache": ExportRecipe(max_len=MAX_LEN, precision="float16", kv_dtype="int8"),
    # what `kvedge plan` recommends on every Orin board (kvedge.planner.recommend)
    "float16-precision-int4-weights-int8-cache": ExportRecipe(
        max_len=MAX_LEN, precision="float16", weights="int4", kv_dtype="int8"
    ),
}
