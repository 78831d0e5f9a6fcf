"""JSON Schemas as the spec reads them: what kvedge rewrites in a schema before llguidance compiles
it. Every rewrite is exact (the same JSON values validate before and after):

    format       an unknown format is an annotation, not a check (JSON Schema 2020-12, validation
                 7.2: unknown formats are ignored): removed and named in `Prepared.ignored`.
                 Formats llguidance knows (date-time, email, uuid, ...) are enforced
    oneOf        -> anyOf where no value can match two branches (`Reader.disjoint`): "exactly one"
                 and "at least one" then mean the same. Otherwise it is left as oneOf, which
                 llguidance compiles only where its own check proves the same, else refuses
    uniqueItems  false, or with maxItems <= 1: always satisfied, removed
    dependentRequired {a: [b]}, dependentSchemas {a: S}, dependencies (either form)
                 -> allOf [anyOf [{a absent}, {a required, and b required / S}]], for up to
                 MAX_DEPENDENCIES trigger properties (each doubles the object's alternatives;
                 llguidance may then write the properties in another order than the schema's)

What llguidance does not implement (uniqueItems true, not, if/then/else, propertyNames, more
dependencies, ...) and a oneOf whose branches may overlap are refused by name
(`refusal`), unless the schema is compiled leniently (`Constraint.lenient`, the service's
`lenient_schemas`): llguidance then ignores those keywords and reads oneOf as anyOf, so the
output may break them; the grammar's warnings name what was ignored (`lenient_notes`).

Disjointness is decided conservatively, from what each branch requires (a branch's other keywords
only narrow it): different types (integer inside number), no const/enum value in common,
numeric ranges that do not meet, or, for objects, a property one branch requires whose schemas
in the two branches are disjoint (a discriminator such as {"kind": {"const": "a"}}). A local
$ref ("#/...") is followed; a branch takes its oneOf's sibling `type`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 16  # $ref hops and nested branches followed when deciding disjointness
MAX_FORMAT = 64  # longer format names are unknown without asking (none is near it)
MAX_DEPENDENCIES = 4  # trigger properties of dependencies rewritten per schema
MAX_NOTES = 8  # notes kept in `Prepared.ignored`; the rest are counted
ONE_SCHEMA = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
)
SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")
NUMERIC = {"integer", "number"}
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._+-]{1,64}")
_ONE_OF_REFUSED = "oneOf constraints are not supported"
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")


@dataclass(frozen=True)
class Prepared:
    schema: Any  # the rewritten schema (a dict, or true/false)
    ignored: tuple[str, ...]  # what the spec says to ignore and kvedge did: 'format=url', ...
    overlapping: tuple[str, ...]  # JSON pointers of the oneOfs left as they were ("" = the root)


def prepare(schema: Any) -> Prepared:
    """`schema` with the module docstring's exact rewrites made."""
    reader = Reader(schema)
    out = reader.rewrite(schema, "")
    return Prepared(out, notes(reader.ignored), tuple(reader.overlapping))


def notes(found: list[str]) -> tuple[str, ...]:
    """`found` without repeats, at most MAX_NOTES of them and a count of the rest."""
    unique = list(dict.fromkeys(found))
    if len(unique) <= MAX_NOTES:
        return tuple(unique)
    return (*unique[:MAX_NOTES], f"{len(unique) - MAX_NOTES} more")


@functools.lru_cache(maxsize=256)
def known_format(name: str) -> bool:
    """Whether llguidance enforces string format `name` (it refuses formats it does not know)."""
    import llguidance

    if len(name) > MAX_FORMAT:
        return False
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return not is_error


def refusal(message: str, prepared: Prepared) -> str:
    """llguidance's refusal `message` said in kvedge's words, naming what to change."""
    if _ONE_OF_REFUSED in message:
        where = ", ".join(p or "the root" for p in prepared.overlapping) or "a oneOf"
        return (
            f"oneOf at {where}: its branches may both match one value, and kvedge compiles oneOf only "
            "where they cannot (different types, no const or enum value in common, or a required "
            "property whose values differ); set lenient_schemas to read it as anyOf (the output may "
            "then match two branches), or write anyOf"
        )
    keys = _UNIMPLEMENTED.search(message)
    if keys:
        return (
            f"JSON Schema keywords {keys.group(1)} are not supported by the constraint library "
            "(llguidance); set lenient_schemas to ignore them (the output may then break them)"
        )
    return message


def lenient_notes(warnings: list[str]) -> list[str]:
    """What llguidance's warnings of a lenient compilation say it did not enforce."""
    found = []
    for warning in warnings:
        keys = _UNIMPLEMENTED.search(warning)
        if keys:
            found += [k.strip().strip('"') for k in keys.group(1).split(",")]
        elif warning.startswith("oneOf not fully supported"):
            found.append("oneOf=anyOf")
        else:
            found.append(warning)
    return found


def format_note(name: str) -> str:
    return "format=" + (name if _PLAIN_NAME.fullmatch(name) else json.dumps(name)[:66])


class Reader:
    """One schema's rewrite: walks its subschemas, resolving local $refs against the root."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.ignored: list[str] = []
        self.overlapping: list[str] = []

    def rewrite(self, schema: Any, path: str) -> Any:
        if not isinstance(schema, dict):
            return schema
        out: dict[str, Any] = {}
        implied: list[Any] = []  # allOf members the dependencies keywords became
        for key, value in schema.items():
            at = f"{path}/{_escape(key)}"
            if key in ONE_SCHEMA and isinstance(value, dict):
                value = self.rewrite(value, at)
            elif key in SCHEMA_LIST and isinstance(value, list):
                value = [self.rewrite(v, f"{at}/{i}") for i, v in enumerate(value)]
            elif key in SCHEMA_MAP and isinstance(value, dict):
                value = {k: self.rewrite(v, f"{at}/{_escape(k)}") for k, v in value.items()}
            if key == "format" and isinstance(value, str) and not known_format(value):
                self.ignored.append(format_note(value))
                continue
            if key == "uniqueItems" and _always_unique(schema):
                continue
            if key in DEPENDENCIES and isinstance(value, dict) and len(value) <= MAX_DEPENDENCIES:
                implied += [_dependency(trigger, then) for trigger, then in value.items()]
                continue
            if key == "oneOf" and isinstance(value, list):
                if "anyOf" not in schema and self.all_disjoint(value, _types(schema)):
                    key = "anyOf"
                else:
                    self.overlapping.append(path)
            out[key] = value
        if implied:
            out["allOf"] = [*out.get("allOf", []), *implied]
        return out

    def all_disjoint(self, branches: list[Any], within: set[str] | None) -> bool:
        narrowed = [_narrow(self.target(b), within) for b in branches]
        return all(self.disjoint(a, b) for i, a in enumerate(narrowed) for b in narrowed[i + 1 :])

    def target(self, schema: Any, depth: int = 0) -> Any:
        """`schema`, or what its local $ref points at (siblings of $ref only narrow it further,
        and before draft 2019-09 they are ignored: the target alone is the safe reading)."""
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < MAX_DEPTH:
            schema, depth = self.pointer(schema["$ref"]), depth + 1
        return schema

    def pointer(self, ref: str) -> Any:
        """The subschema a "#/a/b" reference names; True (anything) for one not found here."""
        if not ref.startswith("#"):
            return True
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node

    def disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        """True only if no JSON value can match both `a` and `b`."""
        if depth > MAX_DEPTH:
            return False
        a, b = self.target(a), self.target(b)
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        for x, y in ((a, b), (b, a)):
            for key in ("anyOf", "oneOf"):
                options = x.get(key)
                if isinstance(options, list) and options:
                    if all(self.disjoint(o, y, depth + 1) for o in options):
                        return True
            members = x.get("allOf")
            if isinstance(members, list) and any(self.disjoint(m, y, depth + 1) for m in members):
                return True
        if _apart(a, b) or _apart(b, a):
            return True
        return self.objects_apart(a, b, depth) or self.objects_apart(b, a, depth)

    def objects_apart(self, a: dict, b: dict, depth: int) -> bool:
        """`a` admits only objects, and some property required by either has disjoint schemas."""
        if _types(a) != {"object"}:
            return False
        required = [k for s in (a, b) for k in _strings(s.get("required"))]
        return any(self.disjoint(_property(a, k), _property(b, k), depth + 1) for k in required)


def _apart(a: dict, b: dict) -> bool:
    """Disjoint by types, const/enum values or numeric range."""
    types_a, types_b = _types(a), _types(b)
    values_a, values_b = _values(a), _values(b)
    if types_a == set():
        return True  # a branch no type is left to
    if types_a is not None and types_b is not None and not _meet(types_a, types_b):
        return True
    if values_a is not None:
        if values_b is not None and not any(x == y for x in values_a for y in values_b):
            return True  # Python's == says equal wherever JSON does (1 == 1.0), and more: safe
        if types_b is not None and not any(_meet({_json_type(v)}, types_b) for v in values_a):
            return True
    if types_a is not None and types_a <= NUMERIC:
        low_a, high_a = _range(a)
        low_b, high_b = _range(b)
        return _below(high_a, low_b) or _below(high_b, low_a)
    return False


def _types(schema: dict) -> set[str] | None:
    """The types `schema`'s "type" allows; None when it does not say."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _widen(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _meet(a: set[str], b: set[str]) -> bool:
    return bool(_widen(a) & _widen(b))


def _narrow(branch: Any, within: set[str] | None) -> Any:
    """`branch` with its types cut to `within` (its oneOf's sibling "type")."""
    if within is None or not isinstance(branch, dict):
        return branch
    own = _types(branch)
    common = _widen(within) & _widen(own) if own is not None else _widen(within)
    if "number" in common:
        common.discard("integer")
    return {**branch, "type": sorted(common)}


def _values(schema: dict) -> list[Any] | None:
    """The only values `schema` allows (const, enum); None when it does not list them."""
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


Limit = tuple[float, bool] | None  # (value, strict); None: no bound


def _range(schema: dict) -> tuple[Limit, Limit]:
    """The numeric (low, high) bounds: minimum / exclusiveMinimum in draft 4's boolean and
    draft 6's number forms."""
    return _bound(schema, "minimum", "exclusiveMinimum", max), _bound(
        schema, "maximum", "exclusiveMaximum", min
    )


def _bound(schema: dict, inclusive: str, exclusive: str, tighter: Any) -> Limit:
    found: list[tuple[float, bool]] = []
    value, flag = schema.get(inclusive), schema.get(exclusive)
    if _number(value):
        found.append((value, flag is True))
    if _number(flag):
        found.append((flag, True))
    if not found:
        return None
    best = tighter(v for v, _ in found)
    return best, any(strict for v, strict in found if v == best)


def _below(high: Limit, low: Limit) -> bool:
    """No number is both <= `high` and >= `low`."""
    if high is None or low is None:
        return False
    return high[0] < low[0] or (high[0] == low[0] and (high[1] or low[1]))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _property(schema: dict, key: str) -> Any:
    """What `schema` asks of property `key`'s value (True: nothing known)."""
    properties = schema.get("properties")
    if isinstance(properties, dict) and key in properties:
        return properties[key]
    if schema.get("patternProperties"):
        return True
    return schema.get("additionalProperties", True)


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _dependency(trigger: str, then: Any) -> dict[str, Any]:
    """ "If property `trigger` is present, the object has the properties `then` lists / matches
    schema `then`" as a schema llguidance compiles: either it is absent, or it is there and so is
    the rest (an object that is not one passes both forms)."""
    rest = {"required": then} if isinstance(then, list) else then
    return {"anyOf": [{"properties": {trigger: False}}, {"required": [trigger], "allOf": [rest]}]}


def _always_unique(schema: dict) -> bool:
    unique, most = schema.get("uniqueItems"), schema.get("maxItems")
    return unique is False or (unique is True and _number(most) and most <= 1)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
