"""The JSON Schema keywords structured outputs enforce, checked before a schema is compiled.

xgrammar (0.2.9) compiles a schema into a grammar but silently drops what it does not
enforce (``not``, ``if``/``then``, ``uniqueItems``, ``multipleOf`` on numbers, unknown
``format`` names ...), so the output would not match the schema while the request got a
200. :func:`check_schema` walks the schema with an allow-list of the keywords that the
grammar really enforces (found by compiling one schema per keyword and testing strings that
it must accept and refuse: ``tests/test_serve_schema_check.py``) and refuses any other by
name, together with schemas that are unsatisfiable in ways that are cheap to see (``false``,
``const`` / ``enum`` values of the wrong ``type``, ``required`` names that
``additionalProperties: false`` forbids, an ``allOf`` of several schemas).
"""

from __future__ import annotations

from edgebuild.errors import RequestError

TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")
FORMATS = (
    "date",
    "date-time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "json-pointer",
    "relative-json-pointer",
    "time",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
)
ANNOTATIONS = frozenset(
    ["title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated"]
    + ["readOnly", "writeOnly"]
)
# keyword -> what its value holds: a schema, schemas (a list), a {name: schema} map, or data
_SUBSCHEMA = {"items": "one", "additionalProperties": "one", "propertyNames": "one"}
_SUBSCHEMA |= {"unevaluatedProperties": "one", "prefixItems": "list", "anyOf": "list"}
_SUBSCHEMA |= {"oneOf": "list", "allOf": "list", "properties": "map", "$defs": "map"}
_SUBSCHEMA |= {"definitions": "map", "patternProperties": "map"}
_DATA = ("type", "enum", "const", "$ref", "required", "minimum", "maximum", "exclusiveMinimum")
_DATA += ("exclusiveMaximum", "minLength", "maxLength", "pattern", "format", "minItems")
_DATA += ("maxItems", "minProperties", "multipleOf")
SUPPORTED = frozenset(_SUBSCHEMA) | frozenset(_DATA) | ANNOTATIONS


def check_schema(schema, field: str) -> None:
    """Refuse a JSON schema (a parsed JSON value) that structured outputs would not enforce.

    Args:
        schema: the schema (a dict, or ``true`` = any JSON value).
        field: the request field it came from (the messages start with it).

    Raises:
        RequestError: ``false`` (nothing matches), a keyword outside :data:`SUPPORTED`, an
            unknown ``type`` or ``format``, ``multipleOf`` on a non-integer, an ``allOf``
            with several schemas, or a cheaply seen contradiction (module docstring); the
            message names the field, the keyword's path and the fix.
    """
    if schema is False:
        raise RequestError(f"{field}: the schema false matches nothing; send a satisfiable schema")
    _walk(schema, field, "schema")


def _walk(schema, field: str, path: str) -> None:
    if isinstance(schema, bool):
        return  # true: anything; false below the root: the place cannot be filled (fine)
    if not isinstance(schema, dict):
        raise RequestError(f"{field}: {path} must be a JSON object or a boolean, got {schema!r}")
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key not in SUPPORTED:
            raise RequestError(
                f"{field}: the JSON Schema keyword {key!r} (at {where}) is not enforced by "
                "structured outputs; remove it. Supported: " + ", ".join(sorted(SUPPORTED))
            )
        kind = _SUBSCHEMA.get(key)
        if kind == "one":
            _walk(value, field, where)
        elif kind == "list":
            if not isinstance(value, list):
                raise RequestError(f"{field}: {where} must be a list of schemas")
            for i, sub in enumerate(value):
                _walk(sub, field, f"{where}[{i}]")
        elif kind == "map":
            if not isinstance(value, dict):
                raise RequestError(f"{field}: {where} must be an object of schemas")
            for name, sub in value.items():
                _walk(sub, field, f"{where}.{name}")
    _check_values(schema, field, path)


def _types(schema: dict, field: str, path: str) -> list[str] | None:
    if "type" not in schema:
        return None
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    for t in types:
        if t not in TYPES:
            raise RequestError(
                f"{field}: {path}.type must be one of {', '.join(TYPES)} (or a list of them), "
                f"got {t!r}"
            )
    return types


def _check_values(schema: dict, field: str, path: str) -> None:
    """The checks on one schema's own keywords (not its subschemas)."""
    types = _types(schema, field, path)
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise RequestError(
            f"{field}: {path}.format {fmt!r} is not enforced by structured outputs; use one of "
            f"{', '.join(FORMATS)}, or a pattern"
        )
    if "multipleOf" in schema and types != ["integer"]:
        raise RequestError(
            f"{field}: {path}.multipleOf is enforced only with type integer (xgrammar ignores "
            "it on numbers); use type integer or remove multipleOf"
        )
    if len(schema.get("allOf") or ()) > 1:
        raise RequestError(
            f"{field}: {path}.allOf with several schemas is not enforced by structured outputs; "
            "merge them into one schema"
        )
    values = [("const", schema["const"])] if "const" in schema else []
    values += [("enum", v) for v in schema.get("enum") or ()]
    for key, value in values if types is not None else ():
        if _type_of(value) not in types and not (
            _type_of(value) == "integer" and "number" in types
        ):
            raise RequestError(
                f"{field}: {path}.{key} value {value!r} is not of type {'/'.join(types)}, so "
                "nothing matches the schema; fix the type or the value"
            )
    if schema.get("additionalProperties") is False and "patternProperties" not in schema:
        props = schema.get("properties") or {}
        missing = [n for n in schema.get("required") or () if n not in props]
        if missing:
            raise RequestError(
                f"{field}: {path}.required names {missing} that additionalProperties: false "
                "forbids (they are not in properties), so nothing matches; add them to "
                "properties or drop them from required"
            )


def _type_of(value) -> str:
    """The JSON Schema type of a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
