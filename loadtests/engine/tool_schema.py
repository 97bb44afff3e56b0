"""Tool `parameters` schemas as SGLang's chat `_validate_request` treats them.

`normalize_types` follows sglang 0.5.22 function_call/utils.py: normalize_json_schema_types (DB/ORM type names are
rewritten in place, so the template renders the rewritten schema). `schema_error` stands in for jsonschema's
`Draft202012Validator.check_schema`: it checks the keywords whose values the 2020-12 meta-schema constrains (and
`pattern` / `patternProperties` keys as regexes, as its format checker does), not `$id`/`$ref` URI syntax.
"""

from __future__ import annotations

import re
from typing import Any

_STANDARD_TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string", "uuid": "string",
    "date": "string", "datetime": "string", "time": "string", "timestamp": "string", "binary": "string",
    "blob": "string", "bytea": "string", "bytes": "string", "varbinary": "string", "bool": "boolean",
    "bigint": "integer", "smallint": "integer", "tinyint": "integer", "double": "number", "decimal": "number",
    "real": "number", "numeric": "number", "arr": "array", "tuple": "array", "set": "array", "map": "object",
}
_TYPE_PREFIXES = ((("int", "uint", "long", "short", "unsigned"), "integer"), (("num", "float"), "number"),
                  (("list",), "array"), (("dict",), "object"))
_PREFIX_END = frozenset("0123456789[<( \t")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties")


def _normalize_type_name(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD_TYPES:
        return base
    if base in _TYPE_ALIASES:
        return _TYPE_ALIASES[base]
    for prefixes, target in _TYPE_PREFIXES:
        if any(base == p or (base.startswith(p) and len(base) > len(p) and base[len(p)] in _PREFIX_END)
               for p in prefixes):
            return target
    return raw


def normalize_types(schema: Any) -> None:
    """Rewrite non-standard `type` names (varchar, int32, list[str], ...) to JSON Schema types, in place."""
    if isinstance(schema, list):
        for item in schema:
            normalize_types(item)
        return
    if not isinstance(schema, dict):
        return
    t = schema.get("type")
    if isinstance(t, str):
        schema["type"] = _normalize_type_name(t)
    elif isinstance(t, list):
        schema["type"] = list(dict.fromkeys(_normalize_type_name(x) for x in t))
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                normalize_types(sub)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                normalize_types(sub)
    for key in _SCHEMA_VALUES:
        if key in schema:
            normalize_types(schema[key])


def _is_int(v: Any) -> bool:  # jsonschema counts 2.0 as an integer
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


def _is_num(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def _is_regex(v: Any) -> bool:
    try:
        re.compile(v)
    except re.error:
        return False
    return True


def _unique_strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v) and len(set(v)) == len(v)


_SCALAR_RULES: dict[str, tuple[Any, str]] = {
    "multipleOf": (lambda v: _is_num(v) and v > 0, "a number > 0"),
    **{k: (_is_num, "a number") for k in ("maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum")},
    **{k: (lambda v: _is_int(v) and v >= 0, "a non-negative integer")
       for k in ("maxLength", "minLength", "maxItems", "minItems", "maxContains", "minContains", "maxProperties",
                 "minProperties")},
    "pattern": (lambda v: isinstance(v, str) and _is_regex(v), "a regex string"),
    "required": (_unique_strings, "an array of unique strings"),
    "enum": (lambda v: isinstance(v, list), "an array"),
    "examples": (lambda v: isinstance(v, list), "an array"),
    **{k: (lambda v: isinstance(v, bool), "a boolean") for k in ("uniqueItems", "deprecated", "readOnly", "writeOnly")},
    **{k: (lambda v: isinstance(v, str), "a string")
       for k in ("title", "description", "$comment", "format", "contentEncoding", "contentMediaType", "$schema",
                 "$ref", "$dynamicRef")},
    "$id": (lambda v: isinstance(v, str) and re.fullmatch(r"[^#]*#?", v) is not None, "a fragment-free URI"),
    **{k: (lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z_][-A-Za-z0-9._]*", v) is not None, "an anchor")
       for k in ("$anchor", "$dynamicAnchor")},
}


def _type_ok(v: Any) -> bool:
    if isinstance(v, str):
        return v in _STANDARD_TYPES
    return (isinstance(v, list) and len(v) > 0 and all(isinstance(x, str) and x in _STANDARD_TYPES for x in v)
            and len(set(v)) == len(v))


def schema_error(schema: Any, path: str = "schema") -> str | None:
    """Why `schema` is not a valid JSON Schema (draft 2020-12), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{schema!r} is not of type 'object', 'boolean' (at {path})"
    if "type" in schema and not _type_ok(schema["type"]):
        return f"{schema['type']!r} is not valid under any of the given schemas (at {path}['type'])"
    for key, (ok, what) in _SCALAR_RULES.items():
        if key in schema and not ok(schema[key]):
            return f"{schema[key]!r} is not {what} (at {path}[{key!r}])"
    if "dependentRequired" in schema and not (isinstance(schema["dependentRequired"], dict)
                                              and all(map(_unique_strings, schema["dependentRequired"].values()))):
        return f"{schema['dependentRequired']!r} is not an object of string arrays (at {path}['dependentRequired'])"
    if "$vocabulary" in schema and not (isinstance(schema["$vocabulary"], dict)
                                        and all(isinstance(v, bool) for v in schema["$vocabulary"].values())):
        return f"{schema['$vocabulary']!r} is not an object of booleans (at {path}['$vocabulary'])"
    for key in (*_SCHEMA_VALUES, "contentSchema"):
        if key in schema and (err := schema_error(schema[key], f"{path}[{key!r}]")):
            return err
    for key in _SCHEMA_LISTS:
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, list) or not subs:
                return f"{subs!r} is not a non-empty array (at {path}[{key!r}])"
            for i, sub in enumerate(subs):
                if err := schema_error(sub, f"{path}[{key!r}][{i}]"):
                    return err
    for key in (*_SCHEMA_MAPS, "dependencies"):
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, dict):
                return f"{subs!r} is not of type 'object' (at {path}[{key!r}])"
            for name, sub in subs.items():
                if key == "patternProperties" and not _is_regex(name):
                    return f"{name!r} is not a 'regex' (at {path}[{key!r}])"
                if key == "dependencies" and _unique_strings(sub):
                    continue
                if err := schema_error(sub, f"{path}[{key!r}][{name!r}]"):
                    return err
    return None
