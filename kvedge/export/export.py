"""`kvedge export`: Hugging Face model -> artifact folder (ONNX graph, tokenizer, manifest)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx.external_data_helper import (
    convert_model_to_external_data,
    save_external_data,
    set_external_data,
    uses_external_data,
)
from tqdm import tqdm

from kvedge.contract import (
    CHAT_TEMPLATE_FILE,
    EMBEDDINGS_FILE,
    HEAD_PARTS,
    HEAD_TABLE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    ONNX_FILE,
    PER_LAYER_FILE,
    QUANT_MATMUL_OP,
    QUANTIZED_KV_DTYPES,
    RING_MARGIN,
    STORED_CHECK_BYTES,
    TOKENIZER_FILE,
    VERIFY_TOKENS,
    WEIGHT_FORMATS,
    CacheGeometry,
    EmbeddingTable,
    ExportRecipe,
    IONames,
    Manifest,
    PerLayerTable,
    RopeSpec,
    StateSpec,
    StoredTensor,
    graph_files,
    kvedge_ops,
    per_layer_dtype,
    sha256_files,
    shared_kv_geometry,
)
from kvedge.errors import KvedgeError
from kvedge.export.graph import (
    STATIC_ROPE_TYPES,
    DecoderSpec,
    DeltaNetSpec,
    all_graphs,
    build_decoder_graph,
    check_ring,
    check_states,
    conv_layers,
    graph_opset,
    local_layers,
    rope_tables,
    rotary_frequencies,
)
from kvedge.export.graph.decoder import runtime_embeddings
from kvedge.export.graph.external import ExternalData, stored_length
from kvedge.export.graph.options import Gemma4Spec, attention_sizes
from kvedge.export.graph.weights import SourceBlocks, source_blocks, tied_head
from kvedge.export.memory import check_export_memory, export_needs, failed_allocation, out_of_memory
from kvedge.export.quantize import calibration_ids, input_outliers, quantize_blockwise
from kvedge.export.source import (
    Opened,
    Source,
    load_hf,
    load_tokenizer,
    opened,
    resolve_source,
    stream_source,
)
from kvedge.export.streamed import row_chunks
from kvedge.files import human, new_folder
from kvedge.machine import map_large_allocations, release_freed_memory

if TYPE_CHECKING:
    from kvedge.export.awq_gptq import PackedWeights
    from kvedge.export.gguf_blocks import GgufWeights

log = logging.getLogger(__name__)

DATA_FILE = ONNX_FILE + ".data"  # the graph's tensors of 1 KiB and more (`save_onnx`)


def recorded(recipe: ExportRecipe, source_blocks_only: bool = False) -> dict[str, Any]:
    """The manifest fields `recipe` decides, as `export_model` writes them (the cache geometry
    aside, which also depends on the model: `differences` checks its part); `source_blocks_only`:
    every quantized matrix is the source's own blocks (`ExportRecipe.kept_channels_of`)."""
    decode = decode_matmuls_recorded(recipe)
    return {
        "logits": recipe.logits,
        "variant": recipe.variant,
        "precision": recipe.precision,
        "opset": graph_opset(recipe),
        "weights_dtype": recipe.weights,
        "weight_block_size": recipe.block_size if recipe.quantized else 0,
        "weight_outlier_channels": recipe.kept_channels_of(source_blocks_only),
        "weight_head_bits": recipe.lm_head_bits if recipe.quantized else 0,
        "weight_decode_matmuls": decode,
        # a decode form exactly where kvedge.QuantMatMul is (`build_decoder_graph`)
        "decode_form_tokens": VERIFY_TOKENS if decode == "kvedge" else 0,
    }


def decode_matmuls_recorded(recipe: ExportRecipe) -> str:
    """What a decode step's quantized matmuls run in this export, as the graph builder decides it
    (`kvedge_ops`: kvedge.QuantMatMul or not); "" for graphs without quantized ort matmuls."""
    if not recipe.decode:
        return ""
    ops = kvedge_ops(recipe.variant, recipe.kv_dtype, recipe.weights, recipe.decode)
    return "kvedge" if QUANT_MATMUL_OP in ops else "onnxruntime"


def differences(recipe: ExportRecipe, manifest: Manifest) -> list[str]:
    """How `manifest` differs from what `recipe` exports (empty: every field it decides matches),
    one "field is X, the recipe gives Y" per field."""
    g = manifest.geometry
    group = 0
    if recipe.kv_dtype in QUANTIZED_KV_DTYPES:
        group = recipe.kv_group_size or CacheGeometry.default_group_size(min(g.head_dim, g.ring_dim))
    # an export of the source's blocks that keeps no float channel may owe it to the rule
    # (`ExportRecipe.kept_channels_of`), which holds where none of its matrices was requantized
    source_only = bool(manifest.weight_source_blocks) and not manifest.weight_outlier_channels
    wanted = {
        **recorded(recipe, source_only),
        "max_len": recipe.max_len,
        "kv dtype": recipe.kv_dtype,
        "kv group size": group,
        "kv key8 layers": list(recipe.kv_key8_layers),
    }
    found = {name: getattr(manifest, name) for name in recorded(recipe)}
    found.update(
        {
            "max_len": g.max_len,
            "kv dtype": g.dtype,
            "kv group size": g.group_size,
            "kv key8 layers": list(g.key8_layers),
        }
    )
    return [
        f"{name} is {found[name]!r}, the recipe gives {value!r}"
        for name, value in wanted.items()
        if found[name] != value
    ]


def export_model(
    source_path: str | Path | None,
    out_dir: str | Path,
    options: ExportRecipe,
    loaded: tuple[Any, Any] | None = None,
    force: bool = False,
    memory_check: bool = True,
) -> Manifest:
    """Export `source_path` (HF folder, GGUF file, or None for the default) into `out_dir`
    (`force`: replacing what is there).

    `loaded` is (model, tokenizer) as `load_hf` returns them for that source, to export several
    variants from one load (the benchmark does); by default the source is read here after the
    memory preflight (`memory_check`: `kvedge.export.memory`), one layer at a time where it can
    be (`stream_source`). A quantized source's blocks (GGUF, AWQ, GPTQ) are stored as they are
    where they fit (`read_source_blocks`)."""
    out = Path(out_dir)
    check_output_folder(out, force)
    source = resolve_source(source_path)
    map_large_allocations()  # or the calibration's heap grows its address range a layer at a time
    staging, needed = None, [0]
    try:
        blocks = read_source_blocks(source, options)
        source_model = opened(*loaded) if loaded else _load(source, options, memory_check)
        least = least_weight_bytes(source_model.model, options.weights)
        needed[:] = [check_free_space(out, least, "at least")]
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = new_folder(out.parent, f".{out.name}.")  # readable by the service user (kvedge.files)
        manifest = _export_into(staging, source, source_model, options, blocks, needed)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if out_of_space(exc):
            raise KvedgeError(
                f"{out.parent}: no space left on the device while writing the export, which needs "
                f"about {human(needed[-1])}; nothing was kept, {out} is unchanged"
            ) from None
        if out_of_memory(exc) and not loaded:
            needs = export_needs(source, options, streamable(source))
            raise KvedgeError(
                f"the export ran out of memory ({failed_allocation(exc)}); {needs}; nothing was kept, "
                f"{out} is unchanged"
            ) from None
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    log.info("wrote %s (%.1f MiB)", out, size / 2**20)
    return manifest


def _export_into(
    staging: Path,
    source: Source,
    source_model: Opened,
    options: ExportRecipe,
    blocks: GgufWeights | PackedWeights | None,
    needed: list[int],
) -> Manifest:
    """The export's files in `staging`: the graph, its large tensors written into the data file
    as they are made (`graph_data`); `needed` gets the bytes the files take once the graph's
    size is known."""
    model, tokenizer = source_model.model, source_model.tokenizer
    config = model.config
    geometry = geometry_from_config(config, options.max_len, options.variant).with_dtype(
        options.kv_dtype, options.kv_group_size or None, options.kv_key8_layers
    )
    spec = DecoderSpec.from_config(config)
    check_ring(geometry, options.variant)
    geometry = check_states(geometry, options)
    *tables, rope = _rope(model, spec, geometry, options.max_len)  # cos, sin, local tables
    names = IONames()
    with graph_data(staging) as sink:
        graph, kept, source_only = _graph(source_model, spec, geometry, tables, names, options, blocks, sink)
    untied = untied_embeddings(source_model, spec, options)
    per_layer_table = save_per_layer(staging, source_model, spec, options)
    del model, blocks, source_model  # their weights, before the files are written
    needed.append(graph_bytes(graph))
    check_free_space(staging, needed[-1] - sink.size, "about")  # what is not written yet
    embeds = any(i.name == names.inputs_embeds for i in graph.graph.input)
    save_onnx(graph, staging, embeds)
    del graph
    table = lookup_table(staging, options, untied) if embeds else None
    template = save_tokenizer(staging, tokenizer)
    generation = model_generation_config(source)
    manifest = Manifest(
        architecture=type(config).__name__.replace("Config", ""),
        model_type=config.model_type,
        source=source.description,
        source_fingerprint=source.fingerprint(),
        geometry=geometry,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_heads=spec.num_heads,
        eos_token_ids=eos_ids(config, tokenizer, getattr(generation, "eos_token_id", None)),
        rope=rope,
        onnx_fingerprint=sha256_files(graph_files(staging)),
        names=names,
        chat_template=bool(template),
        special_tokens=special_tokens(tokenizer),
        embedding=table,
        per_layer=per_layer_table,
        weight_source_blocks=kept,
        **recorded(options, source_only),
    )
    (staging / MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def special_tokens(tokenizer: Any) -> dict[str, str]:
    """The tokenizer's special tokens the chat template may name (`Manifest.special_tokens`)."""
    return {
        key: str(getattr(tokenizer, key))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if getattr(tokenizer, key, None) is not None
    }


# rows of the per-layer table read, scaled and written at a time: 4,096 x 8,960 values (E2B) is
# 147 MiB in float32, against the table's 8.8 GiB
PER_LAYER_CHUNK_ROWS = 4096


def save_per_layer(
    folder: Path, source: Opened, spec: DecoderSpec, options: ExportRecipe
) -> PerLayerTable | None:
    """Gemma 4's per-layer embedding table [rows, layers x P] times sqrt(P) (transformers' scale, in
    float32), float32 for float32 weights, else float16 (`per_layer_dtype`), as PER_LAYER_FILE in
    `folder` (.npy: mapped, not loaded, by the runtime); None for other models. Read, scaled and
    written PER_LAYER_CHUNK_ROWS rows at a time (`row_chunks`), never whole."""
    if spec.gemma4 is None or not spec.gemma4.per_layer:
        return None
    name = "model.embed_tokens_per_layer.weight"
    scale = np.float32(source.model.model.embed_tokens_per_layer.scalar_embed_scale)
    dtype = np.dtype(per_layer_dtype(options.weights))
    shape = tuple(source.model.model.embed_tokens_per_layer.weight.shape)
    path = folder / PER_LAYER_FILE
    with path.open("wb") as handle:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(handle, header)
        for rows in row_chunks(source.weights, name, PER_LAYER_CHUNK_ROWS):
            handle.write((rows * scale).astype(dtype).tobytes())
    with open(path, "rb") as handle:
        first = hashlib.sha256(handle.read(STORED_CHECK_BYTES)).hexdigest()
    return PerLayerTable(PER_LAYER_FILE, dtype.name, shape, first)


def _load(source: Source, options: ExportRecipe, memory_check: bool) -> Opened:
    """`source` streamed, or else loaded whole in float32, each after its memory preflight unless
    skipped (before anything is allocated)."""
    if memory_check:
        # mapped first, so that a limit on the address space (ulimit -v) counts what torch maps, a
        # CUDA wheel (cuBLAS, cuFFT, NCCL...) several times a CPU one's (docs/PERFORMANCE.md,
        # "Exporting at a real size")
        import torch  # noqa: F401

        check_export_memory(source, options, streamed=streamable(source))
    streamed = stream_source(source) if streamable(source) else None
    if streamed is not None:
        return dataclasses.replace(streamed, tokenizer=load_tokenizer(source))
    if memory_check and streamable(source):  # it could not be streamed after all
        check_export_memory(source, options)
    return opened(*load_hf(source))


def streamable(source: Source) -> bool:
    """Whether `source` may be read a tensor at a time (`stream_source` has the last word): not
    an AWQ / GPTQ checkpoint."""
    from kvedge.export.awq_gptq import quantization_config

    return source.gguf_file is not None or not quantization_config(source.folder)


def read_source_blocks(source: Source, options: ExportRecipe) -> GgufWeights | PackedWeights | None:
    """A quantized source's tensors as blocks, which the graph keeps where they fit the recipe
    (`source_blocks`), for an export with quantized weights: a GGUF file's (`read_gguf_weights`;
    types without a block form skipped, to be quantized here) or an AWQ / GPTQ folder's
    (`read_packed_weights`); None for other sources and float exports."""
    if not options.quantized:
        return None
    if source.gguf_file is None:
        from kvedge.export.awq_gptq import quantization_config, read_packed_weights

        return read_packed_weights(source.folder) if quantization_config(source.folder) else None
    from kvedge.export.gguf_blocks import read_gguf_weights  # the export extra's gguf package

    return read_gguf_weights(source.folder / source.gguf_file, skip_unmapped=True)


def _rope(
    model: Any, spec: DecoderSpec, geometry: CacheGeometry, max_len: int
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None, RopeSpec]:
    """The RoPE tables (cos, sin [max_len, d/2], and the sliding-window layers' own or None) and
    the manifest's `RopeSpec`, from the model's rotary embedding."""
    rotary = model.model.rotary_emb
    local_tables, local = None, None
    head_dim = spec.gemma4.global_head_dim if spec.gemma4 else spec.head_dim  # the full layers'
    if spec.local_layers:  # Gemma 3 and 4: one RoPE per layer type, the local layers' own base
        local = rotary.sliding_attention_inv_freq.numpy()
        local_scaling = float(rotary.sliding_attention_attention_scaling)
        local_tables = rope_tables(local, local_scaling, geometry.max_len, spec.head_dim)
        # Gemma 4's global layers: "proportional" RoPE, frequencies [global_head_dim/2] whose pairs
        # past partial_rotary_factor are 0 (HF rotates the whole head with them)
        inv_freq = rotary.full_attention_inv_freq.numpy()
        attention_scaling = float(rotary.full_attention_attention_scaling)
    else:
        # [rotary_dim/2]; for LongRoPE the short factors' set, the one HF uses up to original_max_len
        inv_freq = rotary.inv_freq.numpy()
        attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if 2 * inv_freq.size != (head_dim if spec.gemma4 else spec.rotary_dim):
        raise KvedgeError(
            f"the model rotates {2 * inv_freq.size} channels per head but its config says "
            f"{spec.rotary_dim}; refusing to guess which"
        )
    frequencies = rotary_frequencies(inv_freq, head_dim)
    rope = rope_from_config(model.config, frequencies, attention_scaling, max_len, spec.unrotated_layers)
    if local is not None:
        rope = dataclasses.replace(
            rope, local_layers=spec.local_layers, local_inv_freq=tuple(float(f) for f in local)
        )
    cos, sin = rope_tables(inv_freq, attention_scaling, geometry.max_len, head_dim)
    return cos, sin, local_tables, rope


def _graph(
    source: Opened,
    spec: DecoderSpec,
    geometry: CacheGeometry,
    tables: tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None],
    names: IONames,
    options: ExportRecipe,
    blocks: GgufWeights | PackedWeights | None = None,
    sink: ExternalData | None = None,
) -> tuple[onnx.ModelProto, dict[str, int], bool]:
    """The decoder graph from the source's state dict, with a progress bar over its layers; how
    many of the quantized source's matrices (`blocks`) it keeps as they are, by type ({} for
    other sources); and whether those are all its quantized matrices. The outlier channels of
    quantized weights are measured first (its int8 kernel needs them), where it keeps any
    (`ExportRecipe.kept_channels_of`)."""
    cos, sin, local_tables = tables
    weights = source.weights
    _check_quantizable(spec, geometry, options)
    kept = SourceBlocks({}, {}, {})
    if blocks is not None:
        kept = source_blocks(spec, blocks.tensors, blocks.types, weights, options)
        log.info("source blocks: %s", kept.summary())
    source_only = bool(kept.kept) and not kept.requantized
    outliers, channels = None, options.kept_channels_of(source_only)
    if channels:  # measured before the graph: its int8 kernel needs them
        streamed = source.weights if source.streamed else None
        outliers = input_outliers(source.model, calibration_ids(source.tokenizer), channels, streamed)
        release_freed_memory()  # the calibration's activations, kept by the C heap
    elif options.kept_channels:
        log.info("float channels kept: none, every quantized matrix is the source's blocks")

    with tqdm(total=spec.num_layers or geometry.num_layers, desc="export layers", unit="layer") as bar:
        graph = build_decoder_graph(
            spec,
            geometry,
            weights,
            cos,
            sin,
            names,
            options,
            progress=bar.update,
            outliers=outliers,
            local_tables=local_tables,
            kept=kept.kept,
            sink=sink,
        )
    quant_error = {p.key: p.value for p in graph.metadata_props}.get("kvedge.max_quant_error")
    if quant_error:
        log.info(
            "%s weights, block %d: max |w - w_hat| = %s", options.weights, options.block_size, quant_error
        )
    return graph, kept.kept_types(), source_only


def check_output_folder(out: Path, force: bool) -> None:
    """Refuse an `out` whose contents the export would lose: a file, or a folder holding anything
    but a kvedge export (which --force replaces whole: another folder's files would be gone)."""
    if out.exists() and not out.is_dir():
        raise KvedgeError(f"--out {str(out)!r} is a file; --out names the folder the export writes")
    entries = sorted(entry.name for entry in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if not holds_export(out):
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise KvedgeError(
            f"output folder {str(out)!r} holds {shown}, not a kvedge export ({MANIFEST_FILE}); "
            "--force replaces only a kvedge export: choose another --out or empty this one"
        )
    if not force:
        raise KvedgeError(
            f"output folder {str(out)!r} is not empty; pass --force to overwrite it "
            "(it holds a kvedge export)"
        )


def holds_export(folder: Path) -> bool:
    """True when `folder` has a kvedge export's manifest, of any version (an old export is
    still one to replace), read no further than its format."""
    try:
        data = json.loads((folder / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT


def least_weight_bytes(model: Any, weights: str) -> int:
    """A lower bound of the bytes an export of `model` writes: every parameter at the weights'
    bits (quantization scales, float32 channels and a second decode form only add to it)."""
    return sum(p.numel() for p in model.parameters()) * WEIGHT_FORMATS[weights] // 8


def graph_bytes(graph: onnx.ModelProto) -> int:
    """The bytes of the graph's tensors, every If branch included: what model.onnx.data holds
    (the graph's structure and the tokenizer add a few MiB), those already in it (`graph_data`)
    by their recorded length."""
    return sum(stored_length(t) for g in all_graphs(graph.graph) for t in g.initializer)


def check_free_space(out: Path, needed: int, bound: str) -> int:
    """Refuse an export of `needed` bytes (`bound`: "at least" or "about") into `out` when the
    file system it goes to has less free; returns `needed`. The old export in `out`, if any,
    stays until the new one is complete, so its space does not count as free."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise KvedgeError(
            f"the export needs {bound} {human(needed)} but {existing} has {human(free)} free; "
            "free some space or choose an --out on another disk"
        )
    return needed


def out_of_space(exc: BaseException) -> bool:
    """True when `exc` says the disk is full: an OSError, or the Rust io error the tokenizers
    library raises as a plain Exception ("No space left on device (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    return isinstance(exc, Exception) and f"(os error {errno.ENOSPC})" in str(exc)


def _check_quantizable(spec: DecoderSpec, geometry: CacheGeometry, options: ExportRecipe) -> None:
    """Every quantized MatMul has hidden_size or intermediate_size input features."""
    if not options.quantized:
        return
    sizes = [("hidden_size", spec.hidden_size), ("intermediate_size", spec.intermediate_size)]
    if spec.gemma4 and spec.gemma4.per_layer:  # the input of each layer's per_layer_projection
        sizes.append(("hidden_size_per_layer_input", spec.gemma4.per_layer))
    for name, features in sizes:
        if features % options.block_size:
            raise KvedgeError(
                f"--block-size {options.block_size} does not divide the model's {name} ({features}); "
                "choose a block size that does"
            )
    odd = sorted({d for d in (geometry.head_dim, geometry.ring_dim) if d % 16})
    if options.variant == "ort" and odd:
        raise KvedgeError(
            f"--variant ort needs a head_dim that is a multiple of 16 (GroupQueryAttention "
            f"rotary); this model has {' and '.join(map(str, odd))}"
        )


def geometry_from_config(config: Any, max_len: int, variant: str = "portable") -> CacheGeometry:
    """The cache a config needs at `max_len`: Gemma 3's sliding-window layers get a ring of
    window + RING_MARGIN slots in the portable variant, a full-length cache with a windowed
    attention in the ort variant; another family's sliding window is refused past its width."""
    head_dim, kv_heads = attention_sizes(config)
    window = getattr(config, "sliding_window", None)
    if config.model_type == "gemma4_text":
        return gemma4_geometry(config, max_len, variant)
    if config.model_type == "lfm2":
        return lfm2_geometry(config, max_len, head_dim)
    if config.model_type == "qwen3_5_text":
        return qwen35_geometry(config, max_len, head_dim)
    if config.model_type == "gemma3_text":
        ring = local_layers(config) if variant == "portable" else ()
        return CacheGeometry(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            max_len=max_len,
            ring_layers=ring,
            window=int(window) if ring else 0,
            ring_margin=RING_MARGIN if ring else 0,
        )
    if window and getattr(config, "use_sliding_window", True) and max_len > window:
        raise KvedgeError(
            f"--max-len {max_len} exceeds the model's sliding window ({window}), which the graph "
            f"does not implement; use --max-len <= {window}"
        )
    return CacheGeometry(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=max_len,
    )


def gemma4_geometry(config: Any, max_len: int, variant: str) -> CacheGeometry:
    """Gemma 4's cache (`contract.shared_kv_geometry`): KV for the layers before its shared ones
    only (`Gemma4Spec.shared_layers`), its sliding layers on rings of their own head_dim, its
    global layers max_len of theirs; the ort variant's rings never wrap (docs/ARCHITECTURE.md)."""
    spec = Gemma4Spec.from_config(config)
    head_dim, kv_heads = attention_sizes(config)
    local = set(local_layers(config))
    return shared_kv_geometry(
        [i in local for i in range(config.num_hidden_layers)],
        spec.shared_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        global_head_dim=spec.global_head_dim,
        window=int(config.sliding_window),
        max_len=max_len,
        variant=variant,
    )


def lfm2_geometry(config: Any, max_len: int, head_dim: int) -> CacheGeometry:
    """LFM2's cache: KV for its attention layers only, and a state of the last conv_L_cache - 1
    convolution inputs [conv_L_cache - 1, hidden] for each convolution layer."""
    convs = conv_layers(config)
    attention = tuple(i for i in range(config.num_hidden_layers) if i not in convs)
    if not attention:
        raise KvedgeError("an LFM2 config with no attention layer is not supported (no KV cache to bind)")
    kernel = int(config.conv_L_cache)
    return CacheGeometry(
        num_layers=len(attention),
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        max_len=max_len,
        kv_layers=attention if convs else (),
        states=(StateSpec("conv", convs, (kernel - 1, config.hidden_size)),) if convs and kernel > 1 else (),
    )


def qwen35_geometry(config: Any, max_len: int, head_dim: int) -> CacheGeometry:
    """Qwen3.5's cache: KV for its full-attention layers, and for each Gated DeltaNet layer a
    convolution state [kernel - 1, Q+K+V channels] and a recurrent state [v heads, k dim, v dim]."""
    delta = DeltaNetSpec.from_config(config)
    attention = tuple(i for i in range(config.num_hidden_layers) if i not in delta.layers)
    if not attention or not delta.layers:
        raise KvedgeError(
            "a Qwen3.5 config needs both full_attention and linear_attention layers (it has "
            f"{len(attention)} and {len(delta.layers)})"
        )
    states = (StateSpec("recurrent", delta.layers, (delta.v_heads, delta.k_dim, delta.v_dim)),)
    if delta.kernel > 1:
        states = (StateSpec("conv", delta.layers, (delta.kernel - 1, delta.conv_channels)), *states)
    return CacheGeometry(
        num_layers=len(attention),
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        max_len=max_len,
        kv_layers=attention,
        states=states,
    )


def rope_from_config(
    config: Any,
    inv_freq: np.ndarray,
    attention_scaling: float,
    max_len: int,
    unrotated_layers: tuple[int, ...] = (),
) -> RopeSpec:
    """What the baked tables mean. `inv_freq` [head_dim/2] as `rotary_frequencies` widens it."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "full_attention" in params:  # Gemma 3: per layer type; the full layers' RoPE is recorded
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise KvedgeError(f"rope type {rope_type!r} is not supported; supported: {list(STATIC_ROPE_TYPES)}")
    if rope_type == "longrope":
        # HF switches to the long factors once a sequence passes the pretraining length; the tables
        # are static, so only exports that never get there are exact (short factors throughout).
        original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
        if max_len > original:
            raise KvedgeError(
                f"--max-len {max_len} passes the model's original_max_position_embeddings ({original}), "
                f"where LongRoPE switches to its long factors, which the graph does not implement; "
                f"use --max-len <= {original}"
            )
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        scaling=params,
        inv_freq=tuple(float(f) for f in inv_freq),
        attention_scaling=attention_scaling,
        unrotated_layers=unrotated_layers,
    )


def model_generation_config(source: Any) -> Any:
    from transformers import GenerationConfig

    try:
        kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        return GenerationConfig.from_pretrained(source.folder, **kwargs)
    except (OSError, ValueError, TypeError):
        return None


def eos_ids(config: Any, tokenizer: Any, generation_eos: Any) -> tuple[int, ...]:
    """Union of every end-of-sequence id the config, generation config and tokenizer declare."""
    found: set[int] = set()
    for value in (
        getattr(config, "eos_token_id", None),
        generation_eos,
        getattr(tokenizer, "eos_token_id", None),
    ):
        if value is None:
            continue
        found.update(int(v) for v in np.atleast_1d(value))
    if not found:
        raise KvedgeError("the model declares no eos token id; cannot know when to stop")
    return tuple(sorted(found))


def graph_data(folder: Path) -> ExternalData:
    """The data file `save_onnx` completes in `folder` (which must exist), open for the graph
    builder to write the large tensors into as it makes them (`build_decoder_graph`'s sink):
    then the export holds no weight twice, nor all of them at once. Close it (a `with` block)
    once the graph is built."""
    return ExternalData(folder / DATA_FILE)


def save_onnx(model: onnx.ModelProto, folder: Path, embeds: bool = False) -> list[Path]:
    """The graph in model.onnx, its weights in model.onnx.data. Always apart: protobuf caps a
    file at 2 GiB, and onnxruntime holds weights stored inside the graph file twice, the parsed
    protobuf and its tensors (docs/PERFORMANCE.md, "Tried and dropped"). With `embeds`, the LM
    head's tensors (HEAD_TABLE + HEAD_PARTS) go to the data file whatever their size: the runtime
    reads the embeddings there (`head_table`). Tensors already in the data file (a graph built
    with `graph_data`) stay where they are; what is still inline is appended after them."""
    graph, data = folder / ONNX_FILE, folder / DATA_FILE
    head = {HEAD_TABLE + suffix for suffix in HEAD_PARTS.values()} if embeds else set()
    for g in all_graphs(model.graph):
        for tensor in g.initializer:
            if tensor.name in head and tensor.HasField("raw_data"):
                set_external_data(tensor, data.name)
    # onnx.save_model's own steps, the tensors written one by one under a progress bar (gigabytes
    # at a billion parameters): onnx's default threshold keeps tensors under 1 KiB in the graph
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location=data.name)
    tensors = [t for g in all_graphs(model.graph) for t in g.initializer if uses_external_data(t)]
    total = sum(len(t.raw_data) for t in tensors)
    with tqdm(total=total, desc="export write", unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for tensor in tensors:
            if tensor.HasField("raw_data"):
                bar.update(len(tensor.raw_data))
                save_external_data(tensor, str(folder))
                tensor.ClearField("raw_data")
    onnx.save_model(model, graph)
    data.chmod(graph.stat().st_mode & 0o777)  # onnx creates it owner-only; a service user reads both
    return [graph, data]


# ONNX element types of the LM head's stored tensors -> the numpy dtype of their stored bytes
STORED_DTYPES = {
    onnx.TensorProto.INT4: "uint8",  # packed two per byte, the first in the low nibble
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
}


# an untied model's input embeddings: 8-bit codes (the LM head's default bits), whatever the
# projections' (`write_embedding_table`)
EMBEDDING_BITS = 8


def save_tokenizer(folder: Path, tokenizer: Any) -> str | None:
    """tokenizer.json and, where the model has one, its chat template in `folder`; the template."""
    tokenizer.backend_tokenizer.save(str(folder / TOKENIZER_FILE))
    template = getattr(tokenizer, "chat_template", None)
    if template:
        (folder / CHAT_TEMPLATE_FILE).write_text(template)
    return template


def lookup_table(folder: Path, options: ExportRecipe, untied: np.ndarray | None) -> EmbeddingTable:
    """Where the runtime looks a quantized graph's embeddings up (`EmbeddingTable`): the tied LM
    head's blocks in the saved graph's data file, or an untied table written beside it."""
    if untied is not None:
        return write_embedding_table(folder, untied, options)
    return head_table(folder, options.lm_head_bits, options.block_size)


def untied_embeddings(source: Opened, spec: DecoderSpec, options: ExportRecipe) -> np.ndarray | None:
    """An untied model's input embedding table [vocab, hidden] float32, which a quantized graph's
    lookup reads from a file of its own (`write_embedding_table`); None for a tied model (its
    table is the head's blocks) or a float graph (which gathers from its own table)."""
    if not runtime_embeddings(options) or tied_head(spec, source.weights):
        return None
    table = source.model.get_input_embeddings()
    name = next(n for n, m in source.model.named_modules() if m is table)
    return np.asarray(source.weights[f"{name}.weight"], np.float32)


def write_embedding_table(folder: Path, table: np.ndarray, options: ExportRecipe) -> EmbeddingTable:
    """`table` [vocab, hidden] quantized to EMBEDDING_BITS in blocks of the recipe's size along
    hidden, written to EMBEDDINGS_FILE in `folder` as `EmbeddingTable` reads it: codes [hidden,
    vocab] int8, scales and block offsets [hidden / block, vocab] in the graph's float type, each
    part 64-byte aligned, with a checksum of its first bytes."""
    qw = quantize_blockwise(
        np.ascontiguousarray(table.T, dtype=np.float32), EMBEDDING_BITS, options.block_size
    )
    real = np.float16 if options.half else np.float32
    parts = {"codes": qw.q, "scale": qw.scale.astype(real)}
    if qw.offset is not None:
        parts["side"] = qw.offset.astype(real)
    stored: dict[str, StoredTensor] = {}
    with open(folder / EMBEDDINGS_FILE, "wb") as handle:
        for part, array in parts.items():
            handle.write(bytes(-handle.tell() % 64))
            data = np.ascontiguousarray(array).tobytes()
            stored[part] = StoredTensor(
                offset=handle.tell(),
                length=len(data),
                dtype=str(array.dtype),
                shape=tuple(array.shape),
                sha256=hashlib.sha256(data[:STORED_CHECK_BYTES]).hexdigest(),
            )
            handle.write(data)
    log.info(
        "input embeddings (untied): %d-bit blocks of %d in %s, max |w - w_hat| = %.3g",
        EMBEDDING_BITS,
        options.block_size,
        EMBEDDINGS_FILE,
        qw.max_error,
    )
    return EmbeddingTable(
        file=EMBEDDINGS_FILE,
        bits=EMBEDDING_BITS,
        block_size=options.block_size,
        offsets="side" in stored,
        codes=stored["codes"],
        scale=stored["scale"],
        side=stored.get("side"),
    )


def head_table(folder: Path, bits: int, block_size: int) -> EmbeddingTable:
    """Where the saved graph in `folder` stores its quantized tied LM head of `bits` in blocks of
    `block_size` (`EmbeddingTable`): each part's offset and length in the data file, read back
    from the saved graph, and a checksum of its first bytes."""
    saved = onnx.load(str(folder / ONNX_FILE), load_external_data=False)
    found = {t.name: t for g in all_graphs(saved.graph) for t in g.initializer}
    stored: dict[str, StoredTensor | None] = {}
    for part, suffix in HEAD_PARTS.items():
        tensor = found.get(HEAD_TABLE + suffix)
        if tensor is None:
            stored[part] = None
            continue
        where = {entry.key: entry.value for entry in tensor.external_data}
        file, offset = where["location"], int(where.get("offset", 0))
        with open(folder / file, "rb") as data:
            data.seek(offset)
            first = data.read(min(int(where["length"]), STORED_CHECK_BYTES))
        stored[part] = StoredTensor(
            offset=offset,
            length=int(where["length"]),
            dtype=STORED_DTYPES[tensor.data_type],
            shape=tuple(int(d) for d in tensor.dims),
            sha256=hashlib.sha256(first).hexdigest(),
        )
    kept = stored["kept"]
    table = EmbeddingTable(
        file=file,
        bits=bits,
        block_size=block_size,
        offsets=False,
        codes=stored["codes"],
        scale=stored["scale"],
        side=stored["side"],
        kept=kept,
    )
    return dataclasses.replace(table, offsets=table.side_rows() > (kept.shape[0] if kept is not None else 0))
