"""Extraction on the default model (SmolLM2-135M-Instruct), greedy: 20 JSON schemas, regexes and
choices in one generate call; every output parses, validates and ends with `stop`."""
import json
import re

import pytest

from batchgen import LLM, SamplingParams

# as tests/engine/test_default_model.py: a GPU machine with only a copy of the tree lacks the wheel
from tests.engine.test_default_model import pytestmark  # noqa: F401

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = [
    # (what to ask for, schema)
    ("a person named Bob aged 30", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("the sentiment of 'I love it'", {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]}}, "required": ["label"]}),
    ("a probability", {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]}),
    ("three small numbers", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                             "minItems": 1, "maxItems": 3}),
    ("a user with an id", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"]}}, "required": ["user"]}),
    ("an airport code", {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]}),
    ("a count and an optional note", {"type": "object", "properties": {
        "count": DIGIT, "note": {"type": "string", "maxLength": 5}}, "required": ["count"]}),
    ("whether water is wet", {"type": "boolean"}),
    ("a primary color", {"enum": ["red", "green", "blue"]}),
    ("a version record", {"type": "object", "properties": {
        "version": {"const": 2}, "ok": {"type": "boolean"}}, "required": ["version", "ok"]}),
    ("a list of short keys", {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 4}}, "required": ["k"]}, "minItems": 1, "maxItems": 2}),
    ("a nullable small number", {"type": "object", "properties": {
        "x": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}, "required": ["x"]}),
    ("a number or a short word", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                                            {"type": "string", "maxLength": 3}]}),
    ("today's date", {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    ("a number between 10 and 20", {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}),
    ("a 2x2 matrix", {"type": "object", "properties": {"matrix": {"type": "array", "items": {
        "type": "array", "items": DIGIT, "minItems": 2, "maxItems": 2}, "minItems": 1, "maxItems": 2}},
        "required": ["matrix"]}),
    ("a point", {"$defs": {"pt": {"type": "object", "properties": {"x": DIGIT, "y": DIGIT}, "required": ["x", "y"]}},
                 "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}}, "required": ["p"]}),
    ("a city", {"type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 10}},
                "required": ["city"]}),
    ("the weather", {"type": "object", "properties": {
        "temp": {"type": "integer", "minimum": -50, "maximum": 50}, "unit": {"enum": ["C", "F"]}},
        "required": ["temp", "unit"]}),
    ("a review", {"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}, "tags": {
        "type": "array", "items": {"enum": ["fast", "cheap"]}, "maxItems": 2}}, "required": ["stars", "tags"]}),
]
REGEXES = [("a phone number", r"[0-9]{3}-[0-9]{4}"), ("an email", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
           ("a yes/no answer", r"(yes|no)\.")]
CHOICES = [("Is the sky blue?", ["yes", "no"]), ("Pick a fruit.", ["apple", "banana", "cherry"])]


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only: {what}."}]


def test_extraction_outputs_validate():
    rows = [{"id": f"schema{i}", "messages": ask(what), "response_format": {
        "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}}
        for i, (what, schema) in enumerate(SCHEMAS)]
    rows += [{"id": f"regex{i}", "messages": ask(what), "structured_outputs": {"regex": pattern}}
             for i, (what, pattern) in enumerate(REGEXES)]
    rows += [{"id": f"choice{i}", "messages": ask(what), "structured_outputs": {"choice": choices}}
             for i, (what, choices) in enumerate(CHOICES)]
    # the first schema again, as JSON text of vLLM's form: the same spec, compiled once
    rows.append({"id": "again", "messages": ask(SCHEMAS[0][0]),
                 "structured_outputs": json.dumps({"json": json.dumps(SCHEMAS[0][1])})})
    llm = LLM(max_num_seqs=len(rows))
    by_id = {r["id"]: r for r in llm.generate(rows, SamplingParams(temperature=0, max_tokens=40))}
    for i, (_, schema) in enumerate(SCHEMAS):
        r = by_id[f"schema{i}"]
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), schema)
    for i, (_, pattern) in enumerate(REGEXES):
        r = by_id[f"regex{i}"]
        assert r["finish_reason"] == "stop" and re.fullmatch(pattern, r["text"]), r
    for i, (_, choices) in enumerate(CHOICES):
        r = by_id[f"choice{i}"]
        assert r["finish_reason"] == "stop" and r["text"] in choices, r
    assert by_id["again"]["text"] == by_id["schema0"]["text"]
    assert len(llm.engine.structured._compiled) == len(rows) - 1
