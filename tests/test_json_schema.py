"""kvedge.runtime.json_schema: the exact rewrites made before llguidance compiles a schema, and
the disjointness check that decides when a oneOf may be read as anyOf (pure functions)."""

from __future__ import annotations

import pytest

from kvedge.runtime.json_schema import prepare

DEFS = {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}}
# (oneOf branches, the oneOf's sibling type, whether no value can match two branches)
BRANCHES = [
    ([{"type": "string"}, {"type": "integer"}], None, True),
    ([{"type": "number"}, {"type": "integer"}], None, False),  # 3 is both
    ([{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/i"}], None, True),
    ([{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/i"}], None, False),
    ([{"$ref": "other.json#/a"}, {"type": "integer"}], None, False),  # not followed: anything
    ([{"const": "a"}, {"enum": ["b", "c"]}], None, True),
    ([{"const": 1}, {"enum": [1.0]}], None, False),
    ([{"const": "a"}, {"type": "integer"}], None, True),
    ([{"type": "integer", "maximum": 0}, {"minimum": 1}], None, True),
    ([{"type": "number", "exclusiveMaximum": 1}, {"type": "number", "minimum": 1}], None, True),
    ([{"type": "number", "maximum": 1}, {"type": "number", "minimum": 1}], None, False),
    ([{"maximum": 0}, {"minimum": 1}], None, False),  # "a" matches both
    ([{"required": ["a"]}, {"required": ["b"]}], "object", False),  # {"a": 1, "b": 2}
    (
        [
            {"properties": {"k": {"const": "x"}}, "required": ["k"]},
            {"properties": {"k": {"const": "y"}}, "required": ["k"]},
        ],
        "object",
        True,
    ),
    (
        [
            {"properties": {"k": {"const": "x"}}, "required": ["k"]},
            {"properties": {"k": {"const": "y"}}, "required": ["k"]},
        ],
        None,
        False,  # "x", a string, matches both
    ),
    (
        [
            {"properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
            {"properties": {"b": {}}, "required": ["b"], "additionalProperties": False},
        ],
        "object",
        True,
    ),
    ([{"type": "string"}, {"anyOf": [{"type": "integer"}, {"type": "null"}]}], None, True),
    ([{"type": "string"}, {"anyOf": [{"type": "integer"}, {}]}], None, False),
    ([{"type": "string"}, {"allOf": [{"type": "integer"}, {}]}], None, True),
    ([{"type": "string"}, False], None, True),
    ([{"type": "string"}, {"type": "integer"}], "string", True),
]


@pytest.mark.parametrize("branches, within, apart", BRANCHES)
def test_one_of_becomes_any_of_exactly_where_no_value_matches_two_branches(branches, within, apart):
    schema = {"$defs": DEFS, "oneOf": branches, **({"type": within} if within else {})}
    prepared = prepare(schema)
    assert ("anyOf" in prepared.schema) == apart
    assert ("oneOf" in prepared.schema) != apart
    assert prepared.overlapping == (() if apart else ("",))


def test_unknown_formats_go_and_known_ones_stay_wherever_a_schema_is():
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string", "format": "url"},  # a property named "format" stays
            "day": {"type": "string", "format": "date"},
            "list": {"type": "array", "items": {"format": "bad\r\nname"}},
        },
        "$defs": {"x": {"format": "url"}},
        "default": {"format": "url"},  # data, not a schema
    }
    prepared = prepare(schema)
    properties = prepared.schema["properties"]
    assert properties["format"] == {"type": "string"}
    assert properties["day"]["format"] == "date"
    assert properties["list"]["items"] == {}
    assert prepared.schema["$defs"]["x"] == {}
    assert prepared.schema["default"] == {"format": "url"}
    assert prepared.ignored == ("format=url", 'format="bad\\r\\nname"')  # one line, ASCII


def test_always_satisfied_keywords_go_and_dependencies_become_any_of():
    assert prepare({"type": "array", "uniqueItems": False}).schema == {"type": "array"}
    assert prepare({"uniqueItems": True, "maxItems": 1}).schema == {"maxItems": 1}
    assert prepare({"uniqueItems": True}).schema == {"uniqueItems": True}
    schema = prepare({"allOf": [{"type": "object"}], "dependentRequired": {"a": ["b"]}}).schema
    either = {"anyOf": [{"properties": {"a": False}}, {"required": ["a"], "allOf": [{"required": ["b"]}]}]}
    assert schema == {"allOf": [{"type": "object"}, either]}
    many = {"dependentRequired": {k: ["z"] for k in "abcde"}}
    assert prepare(many).schema == many  # beyond MAX_DEPENDENCIES: left for llguidance to refuse
