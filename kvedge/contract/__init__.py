"""The contract between offline tools and the runtime: what every artifact is and holds.

Both sides import from here; nothing here imports from `kvedge.export` or `kvedge.runtime`.

Artifact folder written by `kvedge export`::

    model.onnx            the graph; its weights in model.onnx.data
    embeddings.bin        an untied quantized model's input embeddings (`EmbeddingTable`)
    tokenizer.json        Hugging Face `tokenizers` file
    chat_template.jinja   the model's chat template (absent for models without one)
    manifest.json         `Manifest` (`kvedge.contract.manifest`), as JSON
    model.engine          with `--target tensorrt`: the engine, and beside it
    engine_manifest.json  `EngineManifest` (`kvedge.contract.engine`)

Modules: `recipe` (`ExportRecipe`, every choice an export makes), `manifest` (cache geometry,
graph names and interface, the model manifest), `models`
(the model families an export may hold, the chat roles), `engine`
(the TensorRT engine manifest and profiles), `header` (the one header check every artifact kind
is loaded through: JSON shape, field types, format, version, model, cache geometry).
"""

from kvedge.contract.manifest import (
    CHAT_TEMPLATE_FILE,
    DECODE_MATMULS,
    EMBEDDINGS_FILE,
    EXPORTED_KV_DTYPES,
    HEAD_PARTS,
    HEAD_TABLE,
    IN_PLACE_VARIANTS,
    INT8_ATTENTION_OP,
    KV_DTYPES,
    KV_GROUP_SIZES,
    KV_SCALE_DTYPE,
    KVEDGE_OPS_DOMAIN,
    LOGITS_MODES,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    ONNX_FILE,
    PER_LAYER_DTYPES,
    PER_LAYER_FILE,
    PRECISIONS,
    PREFILL_CHUNK,
    QUANT_MATMUL_OP,
    QUANTIZED_KV_DTYPES,
    RING_MARGIN,
    SIDE_INPUTS_OP,
    STATE_KINDS,
    STORED_CHECK_BYTES,
    TOKENIZER_FILE,
    VARIANTS,
    VERIFY_TOKENS,
    WEIGHT_FORMATS,
    CacheGeometry,
    EmbeddingTable,
    GraphInterface,
    IONames,
    Manifest,
    PerLayerTable,
    RopeSpec,
    StateSpec,
    StoredTensor,
    TensorSpec,
    export_kv_dtypes,
    export_weight_formats,
    graph_files,
    kvedge_ops,
    sha256_files,
)
from kvedge.contract.models import HYBRID_LAYER_TYPES, ROLES, SUPPORTED_MODEL_TYPES
from kvedge.contract.recipe import (
    BLOCK_SIZES,
    HEAD_BITS,
    HEAD_MIN_BITS,
    OUTLIER_CHANNELS,
    OUTLIER_CHOICES,
    ExportRecipe,
    check_kv_dtype,
)

__all__ = [
    "BLOCK_SIZES",
    "HEAD_BITS",
    "HEAD_MIN_BITS",
    "OUTLIER_CHANNELS",
    "OUTLIER_CHOICES",
    "ExportRecipe",
    "check_kv_dtype",
    "CHAT_TEMPLATE_FILE",
    "DECODE_MATMULS",
    "EXPORTED_KV_DTYPES",
    "HEAD_PARTS",
    "EMBEDDINGS_FILE",
    "PER_LAYER_DTYPES",
    "PER_LAYER_FILE",
    "PerLayerTable",
    "HEAD_TABLE",
    "IN_PLACE_VARIANTS",
    "INT8_ATTENTION_OP",
    "KVEDGE_OPS_DOMAIN",
    "KV_DTYPES",
    "KV_GROUP_SIZES",
    "KV_SCALE_DTYPE",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "ONNX_FILE",
    "PRECISIONS",
    "LOGITS_MODES",
    "PREFILL_CHUNK",
    "QUANTIZED_KV_DTYPES",
    "RING_MARGIN",
    "ROLES",
    "QUANT_MATMUL_OP",
    "SIDE_INPUTS_OP",
    "STATE_KINDS",
    "STORED_CHECK_BYTES",
    "SUPPORTED_MODEL_TYPES",
    "HYBRID_LAYER_TYPES",
    "TOKENIZER_FILE",
    "VARIANTS",
    "VERIFY_TOKENS",
    "WEIGHT_FORMATS",
    "CacheGeometry",
    "EmbeddingTable",
    "GraphInterface",
    "IONames",
    "Manifest",
    "RopeSpec",
    "StateSpec",
    "StoredTensor",
    "TensorSpec",
    "export_kv_dtypes",
    "export_weight_formats",
    "graph_files",
    "kvedge_ops",
    "sha256_files",
]
