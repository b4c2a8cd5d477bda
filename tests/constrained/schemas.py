"""JSON schemas for constrained-decoding tests: (name, schema) pairs, reused end to end.

Each schema is finite enough that a short generation can complete it, and each exercises a
feature users rely on: nesting, arrays with bounds, enums, numeric ranges, required fields,
string patterns and lengths, booleans, null, unions, const and $ref.
"""

from __future__ import annotations

from typing import Any

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "simple_object",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    ),
    (
        "nested_object",
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["name", "address"],
                }
            },
            "required": ["person"],
        },
    ),
    (
        "array_min_max",
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}
            },
            "required": ["tags"],
        },
    ),
    (
        "enum_string",
        {
            "type": "object",
            "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
    ),
    (
        "integer_range",
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 100}},
            "required": ["n"],
        },
    ),
    (
        "number_range",
        {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": -10.5, "maximum": 10.5}},
            "required": ["x"],
        },
    ),
    (
        "required_and_optional",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "note": {"type": "string"},
                "score": {"type": "number"},
            },
            "required": ["id"],
        },
    ),
    (
        "string_pattern",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
            "required": ["code"],
        },
    ),
    (
        "boolean",
        {
            "type": "object",
            "properties": {"flag": {"type": "boolean"}, "other": {"type": "boolean"}},
            "required": ["flag", "other"],
        },
    ),
    (
        "null",
        {
            "type": "object",
            "properties": {"nothing": {"type": "null"}},
            "required": ["nothing"],
        },
    ),
    (
        "array_of_objects",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "done": {"type": "boolean"}},
                "required": ["id", "done"],
            },
            "minItems": 2,
            "maxItems": 4,
        },
    ),
    (
        "nested_arrays",
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["matrix"],
        },
    ),
    (
        "fixed_length_array",
        {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
    ),
    (
        "any_of",
        {
            "type": "object",
            "properties": {
                "value": {
                    "anyOf": [
                        {"type": "string", "maxLength": 40},
                        {"type": "integer", "minimum": -1000, "maximum": 1000},
                    ]
                }
            },
            "required": ["value"],
        },
    ),
    (
        "nullable",
        {
            "type": "object",
            "properties": {"maybe": {"type": ["string", "null"], "maxLength": 40}},
            "required": ["maybe"],
        },
    ),
    (
        "const",
        {
            "type": "object",
            "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
            "required": ["version", "kind"],
        },
    ),
    (
        "string_length",
        {
            "type": "object",
            "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
            "required": ["word"],
        },
    ),
    (
        "defs_ref",
        {
            "type": "object",
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                }
            },
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
        },
    ),
    (
        "enum_mixed",
        {
            "type": "object",
            "properties": {"choice": {"enum": [1, "two", None, True]}},
            "required": ["choice"],
        },
    ),
    (
        "exclusive_bounds",
        {
            "type": "object",
            "properties": {
                "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["level", "ratio"],
        },
    ),
    # Keywords beside one xgrammar reads alone (anyOf, allOf, enum), folded into it: they were
    # dropped, and "b" came out a string, "a" was missing, 1 was in a string enum.
    (
        "properties_beside_anyof_of_required",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
    ),
    (
        "required_beside_allof",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "allOf": [{"properties": {"c": {"type": "string"}}, "required": ["c"]}],
        },
    ),
    (
        "type_beside_enum_and_anyof",
        {
            "type": "object",
            "properties": {
                "kind": {"type": "string", "enum": ["x", 1, "y"]},
                "code": {"type": "string", "anyOf": [{"maxLength": 2}, {"pattern": "^z+$"}]},
            },
            "required": ["kind", "code"],
        },
    ),
]
