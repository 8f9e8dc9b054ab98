"""The `$ref`s of a JSON schema that constrains decoding, checked before it is compiled.

xgrammar resolves a `$ref` only as a JSON pointer into the schema itself ("#", "#/$defs/Item"); it
reads any other reference (a URL, a file, an anchor such as "#node", `$dynamicRef`) as "any JSON
value", so the output would be silently unconstrained. And a reference that leads back to itself
through references alone ({"$ref": "#"}) matches no value at all: generation would fail at its first
token. Both are refused here with a message naming the reference.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import unquote

# keywords whose value maps names to subschemas (a name there is not a keyword)
SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
# keywords whose value is JSON data, not a schema: a "$ref" key inside is data
DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
UNSUPPORTED = ("$dynamicRef", "$recursiveRef")


class SchemaRefError(ValueError):
    """A reference the compiler cannot honour; the message is one line."""


def check_refs(schema: Any) -> None:
    """SchemaRefError for the first `$ref` of `schema` (a parsed JSON schema) that is not a JSON
    pointer into the schema, points to nothing, or leads back to itself through references alone."""
    todo: list[tuple[Any, tuple]] = [(schema, ())]
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNSUPPORTED:
            if keyword in node:
                raise SchemaRefError(f"{keyword} at {_pointer(path)} is not supported; use $ref with a JSON pointer "
                                     f"(#/$defs/...)")
        if isinstance(node.get("$ref"), str):
            _check_chain(schema, node, path)
        for key, value in node.items():
            if key in DATA_KEYWORDS:
                continue
            if key in SCHEMA_MAPS and isinstance(value, dict):
                todo.extend((sub, (*path, key, name)) for name, sub in value.items())
            elif isinstance(value, dict):
                todo.append((value, (*path, key)))
            elif isinstance(value, list):
                todo.extend((item, (*path, key, i)) for i, item in enumerate(value))


def _check_chain(schema: Any, node: dict, path: tuple) -> None:
    """The references from `node` on, as long as each target is itself a reference: each must resolve,
    and none may come back to a schema already on the chain (no value can match such a schema)."""
    seen = {id(node)}
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        node = resolve(schema, ref, path)
        if id(node) in seen:
            raise SchemaRefError(f"$ref {ref!r} at {_pointer(path)} refers back to itself through references "
                                 f"alone: no JSON value can match it")
        seen.add(id(node))


def resolve(schema: Any, ref: str, path: tuple = ()) -> Any:
    """The subschema that `ref`, a JSON pointer in URI fragment form ("#/a/b"), names in `schema`."""
    where = _pointer(path)
    if ref != "#" and not ref.startswith("#/"):
        raise SchemaRefError(f"$ref {ref!r} at {where} is not supported: only references within the schema "
                             f"(a JSON pointer such as #/$defs/Item) are; inline the schema it refers to")
    node = schema
    for token in ref[2:].split("/") if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise SchemaRefError(f"$ref {ref!r} at {where} points to nothing in the schema")
    return node


def _pointer(path: tuple) -> str:
    """A location in the schema as a JSON pointer fragment: # for the root, #/properties/a below it."""
    if not path:
        return "the root (#)"
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)
