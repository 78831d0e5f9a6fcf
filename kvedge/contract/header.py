"""One header check for every artifact kind: format, version, what it was made from, cache geometry.

Artifacts, their format names, and where their header is read::

    manifest.json         kvedge-manifest    `Manifest.load` (kvedge.contract.manifest)
    engine_manifest.json  kvedge-engine      `EngineManifest.load` (kvedge.contract.engine)
    kv_scales.json        kvedge-kv-scales   `Scales.load` (kvedge.quant)
    <name>.kvw            magic KVEDGEWM     `read_warm_file` (kvedge.runtime.prefix)

Reading one, in order: `decode_json` (a JSON object, or ArtifactMismatch; never a
RecursionError for deep nesting), `read_artifact` (format and version first, so an old file is
named as old, not as malformed; then `convert` to the artifact's frozen dataclass: msgspec checks
every field's type, errors name the path, "Expected `int`, got `str` - at
`$.geometry.max_len`"), then `check_header` against what is in use: the source model's
fingerprint, the cache geometry fields the artifact depends on, and anything else it was made
from. Each refusal names the artifact, the field and both values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from kvedge.errors import ArtifactMismatch, KvedgeError

T = TypeVar("T")


@dataclass(frozen=True)
class Header:
    """What an artifact says it is and was made from (found), or what its loader needs (expected).
    A field left None in the expected header is not checked."""

    format: str
    version: int
    model: str | None = None  # the source model's fingerprint: which weights
    geometry: Mapping[str, Any] | None = None  # `CacheGeometry.artifact_key` of the cache it fits
    made_from: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"graph": onnx fingerprint}


@dataclass(frozen=True)
class _Stamp:
    format: str
    format_version: int


def decode_json(raw: bytes, where: str) -> dict[str, Any]:
    """The JSON object in `raw`; ArtifactMismatch for anything else."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ArtifactMismatch(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ArtifactMismatch(f"{where}: not a kvedge header (JSON nested too deeply)") from None
    if not isinstance(data, dict):
        raise ArtifactMismatch(f"{where}: expected a JSON object, found a {type(data).__name__}")
    return data


def read_artifact(data: dict[str, Any], cls: type[T], kind: Header, where: str, remedy: str) -> T:
    """`data` as `cls`, if it states `kind`'s format and version: those are checked first, so an
    old file is named as old rather than as malformed."""
    found = convert(data, _Stamp, where)
    check_header(where, Header(found.format, found.format_version), kind, remedy)
    return convert(data, cls, where)


def convert(data: Any, cls: type[T], where: str) -> T:
    """`data` as `cls` (a frozen dataclass), every field's type checked; ArtifactMismatch naming
    the field otherwise. Unknown fields are ignored, so newer files with extra fields still load."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ArtifactMismatch(f"{where}: malformed header: {exc}") from None
    except KvedgeError as exc:  # a value the dataclass itself refuses, e.g. a CacheGeometry
        raise ArtifactMismatch(f"{where}: {exc}") from None


def check_header(where: str, found: Header, expected: Header, remedy: str = "") -> None:
    """Refuse `found` unless it matches `expected` in format, version, model, cache geometry and
    every `made_from` entry expected; the message names the field and both values."""
    then = f"; {remedy}" if remedy else ""
    if found.format != expected.format:
        raise ArtifactMismatch(f"{where}: format {found.format!r} is not {expected.format!r}{then}")
    if found.version != expected.version:
        raise ArtifactMismatch(
            f"{where}: format version {found.version!r} does not match this kvedge ({expected.version}){then}"
        )
    checks = [("model", found.model, expected.model), ("cache geometry", found.geometry, expected.geometry)]
    checks += [(name, found.made_from.get(name), value) for name, value in expected.made_from.items()]
    for what, have, want in checks:
        if want is not None and have != want:
            raise ArtifactMismatch(f"{where}: {what} is {_short(have)}, expected {_short(want)}{then}")


def _short(value: Any) -> str:
    """A fingerprint as its first 16 characters, anything else as (at most 80 characters of) JSON."""
    if isinstance(value, str):
        return repr(value[:16])
    return json.dumps(value, sort_keys=True)[:80]
