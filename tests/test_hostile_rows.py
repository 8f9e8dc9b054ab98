"""Hostile rows (issue #45: lone surrogates, integers past int64, huge prompts, colliding fallback ids,
content parts, $refs xgrammar would ignore): each becomes one error row, or one answer, on every path
-- `run` on JSONL and Parquet, the OpenAI input, the Python API, and the queue (submit, then a worker)
-- the job exits 0, and no other row is affected.

A tiny random model whose tokenizer is given a chat template that renders tool_calls, and adds 1 to
a message's `weight` field (a template that raises TypeError for weight "heavy", as a real template
may fail on a field of a type it did not expect). Greedy, 3 tokens a row, float32.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import LLM, SamplingParams
from batchgen.io.openai_input import CHAT_URL
from batchgen.queue import Worker, WorkerConfig, collect_job, submit_job
from batchgen.queue.metrics import WorkerMetrics
from batchgen.schema import FieldError, check_structured
from tests.openai_types import line, read_lines
from tests.redis_server import prefix, redis_server  # noqa: F401
from tests.test_queue import Running, client, keys, results, wait_for  # noqa: F401
from tests.tiny_models import VOCAB

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is defined %}{{ m['content'] }}{% endif %}"
    "{% for call in m['tool_calls'] or [] %}[call {{ call['function']['name'] }}]{% endfor %}"
    "{% if m['weight'] is defined %} weight {{ m['weight'] + 1 }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
OPTIONS = ["--max-tokens", "3", "--temperature", "0", "--dtype", "float32", "--device", "cpu"]
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
URL_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}

# (row, a fragment of its error; None: answered). The same rows for every path that takes native rows.
ENGINE_ROWS = [
    ({"id": "s1", "prompt": "\ud800 hi"}, "prompt is not valid Unicode: lone surrogate at character 0"),
    ({"id": "s2", "messages": [{"role": "user", "content": "hi \udc00"}]},
     "messages[0].content is not valid Unicode: lone surrogate at character 3"),
    ({"id": "s3", "prompt": "hi", "stop": ["ok", "\udfff"]}, "stop[1] is not valid Unicode"),
    ({"id": "i1", "prompt": "hi", "top_k": 1e25}, "top_k must be <= 2147483647"),
    ({"id": "i2", "prompt": "hi", "min_tokens": 10**20}, "min_tokens must be <= 2147483647"),
    ({"id": "i3", "prompt": "hi", "seed": 10**20}, "seed must be <= 9223372036854775807"),
    ({"id": "i4", "prompt": "hi", "stop_token_ids": [-3, 10**12]}, "stop_token_ids[0] must be >= 0, got -3"),
    ({"id": "i5", "prompt": "hi", "stop_token_ids": [7, 5000]},
     f"stop_token_ids[1] is 5000, outside the vocabulary [0, {VOCAB})"),
    ({"id": "i6", "prompt": "hi", "max_tokens": 10**20}, "max_tokens must be <= 2147483647"),
    ({"id": "i7", "prompt": "hi", "n": 10**20}, "n must be in [1, 1024]"),
    ({"id": "i8", "prompt": "hi", "top_logprobs": 10**20}, "top_logprobs must be in [0, 20]"),
    ({"id": "c1", "messages": [{"role": "user", "content": [{"type": "text", "text": "the quick"},
                                                            {"type": "text", "text": "brown fox"}]}]}, None),
    ({"id": "c2", "messages": [{"role": "user", "content": "weather?"},
                               {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                               {"role": "tool", "content": "sunny"}]}, None),
    ({"id": "c3", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                            {"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "messages[0].content[1] is not a text part (type 'image_url'); batchgen takes text only"),
    ({"id": "c4", "messages": [{"role": "user", "content": None}]},
     "messages[0].content must be a string or a list of text parts, got null"),
    ({"id": "t1", "messages": [{"role": "user", "content": "hi", "weight": "heavy"}]},
     "the model's chat template failed on these messages: TypeError"),
    ({"id": "t2", "messages": [{"role": "user", "content": "hi", "weight": 2}]}, None),
    ({"id": "r1", "prompt": "hi", "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "a", "schema": URL_SCHEMA}}},
     "response_format.json_schema.schema: $ref 'https://example.com/a.json' at #/properties/a is not supported"),
    ({"id": "r2", "prompt": "hi", "structured_outputs": {"json": {"$ref": "#"}}},
     "structured_outputs.json: $ref '#' at the root (#) refers back to itself"),
    ({"id": "ok", "prompt": "the quick brown fox"}, None),
]
# What only the file and queue paths check: ids and carried-through columns (the Python API hands both
# back as they are; the engine never encodes them).
FILE_ROWS = [
    ({"id": "\udc00", "prompt": "hi"}, "id is not valid Unicode: lone surrogate at character 0"),
    ({"id": "f2", "prompt": "hi", "note": "a\ud800b"},
     "column note is not valid Unicode: lone surrogate at character 1"),
    ({"id": 10**20, "prompt": "hi"}, "id must be <= 9223372036854775807"),
    ({"id": "#line:3", "prompt": "hi"}, "has the form of the ids batchgen gives rows without a usable id"),
    ({"id": "ok", "prompt": "again"}, "id 'ok' already seen in this input"),
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tests.tiny_models import build

    path = build("llama", tmp_path_factory.mktemp("tiny-chat"))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(str(chat_model), dtype="float32", device="cpu", max_num_seqs=8)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    # json.dumps escapes a lone surrogate as \ud800: valid JSON in a valid UTF-8 file
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_answers(out_rows: list[dict], expected: dict) -> None:
    """out_rows: one per input row; expected: id -> error fragment or None."""
    by_id = {r["id"]: r for r in out_rows}
    assert len(by_id) == len(out_rows) == len(expected), sorted(map(str, by_id))
    for row_id, fragment in expected.items():
        row = by_id[row_id]
        if fragment is None:
            assert row["error"] is None and row["finish_reason"] in ("stop", "length") and row["text"] is not None, row
        else:
            assert row["finish_reason"] == "error" and fragment in row["error"], (row_id, row["error"])
            assert "\n" not in row["error"]


# --- batchgen run ---------------------------------------------------------------------------------


def test_run_on_jsonl_gives_each_hostile_row_one_error_row(batchgen, chat_model, tmp_path):
    rows = [r for r, _ in ENGINE_ROWS + FILE_ROWS]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, _, err = batchgen("run", src, out, "--model", chat_model, *OPTIONS)
    assert code == 0, err
    expected = {r["id"]: fragment for r, fragment in ENGINE_ROWS}
    # fallback ids, by line number (1-based): the bad id, the one past int64, the reserved form, the repeat
    lines = {i + 1: fragment for i, (_, fragment) in enumerate(ENGINE_ROWS + FILE_ROWS)}
    first = len(ENGINE_ROWS) + 1
    expected.update({f"#line:{first}": lines[first], "f2": lines[first + 1], f"#line:{first + 2}": lines[first + 2],
                     f"#line:{first + 3}": lines[first + 3], f"#line:{first + 4}": lines[first + 4]})
    table = pq.read_table(out)
    check_answers(table.to_pylist(), expected)
    assert next(r for r in table.to_pylist() if r["id"] == "f2")["note"] == "a\ufffdb"  # carried, made writable


def test_run_on_parquet_with_strings_that_are_not_utf8_and_a_repeated_integer_id(batchgen, chat_model, tmp_path):
    """A Parquet string holding a surrogate's bytes (not UTF-8) is one error row, not a failed batch; in an
    integer id column a fallback id cannot be stored: the id is null and the error names the row."""
    prompts = pa.array([b"the quick brown fox", b"\xed\xa0\x80 hi", b"hi", b"hi", b"hi"], pa.binary()).view(pa.string())
    notes = pa.array([b"a", b"b", b"\xed\xb0\x80", b"d", b"e"], pa.binary()).view(pa.string())
    table = pa.table({"id": pa.array([1, 2, 3, 1, 5], pa.int64()), "prompt": prompts, "note": notes,
                      "top_k": pa.array([None, None, None, None, 2**40], pa.int64())})
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    out = tmp_path / "out.parquet"
    code, _, err = batchgen("run", src, out, "--model", chat_model, *OPTIONS)
    assert code == 0, err
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 5 and pq.read_schema(out).field("id").type == pa.int64()
    answers = {(r["id"], r["note"], r["error"]) for r in rows if r["error"] is not None}
    assert answers == {
        (None, None, "column prompt is not valid UTF-8 (at byte 0 of its value) (#row:1)"),
        (None, None, "column note is not valid UTF-8 (at byte 0 of its value) (#row:2)"),
        (None, "d", "id 1 already seen in this input (#row:3)"),
        (5, "e", "top_k must be <= 2147483647, got 1099511627776"),
    }
    [good] = [r for r in rows if r["error"] is None]
    assert good["id"] == 1 and good["note"] == "a" and good["text"] is not None


def test_openai_input_gives_each_hostile_line_one_error_line(batchgen, chat_model, tmp_path):
    lines = [
        line("\ud800", CHAT_URL, messages=[{"role": "user", "content": "hi"}]),
        line("a", CHAT_URL, messages=[{"role": "user", "content": "hi \udfff"}]),
        line("b", CHAT_URL, messages=[{"role": "user", "content": "hi"}], top_k=1e25),
        line("c", CHAT_URL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        line("d", CHAT_URL, messages=[{"role": "user", "content": "hi"}],
             response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": URL_SCHEMA}}),
        line("e", CHAT_URL, messages=[{"role": "user", "content": [{"type": "text", "text": "the quick"}]},
                                      {"role": "assistant", "tool_calls": [TOOL_CALL]},
                                      {"role": "tool", "content": "sunny"}]),
        line("f", CHAT_URL, messages=[{"role": "user", "content": "hi"}], stop_token_ids=[10**12]),
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code, _, err = batchgen("run", src, out, "--model", chat_model, "--input-format", "openai", *OPTIONS)
    assert code == 0, err
    answers = read_lines(out)
    assert len(answers) == len(lines)
    errors = {a["custom_id"]: a["error"] and a["error"]["message"] for a in answers}
    assert errors["e"] is None
    assert errors[None] == "custom_id is not valid Unicode: lone surrogate at character 0 (line 1)"
    assert errors["a"] == "body.messages[0].content is not valid Unicode: lone surrogate at character 3"
    assert "top_k must be <= 2147483647" in errors["b"]
    assert "content[0] is not a text part (type 'image_url')" in errors["c"]
    assert "$ref 'https://example.com/a.json' at #/properties/a is not supported" in errors["d"]
    assert "stop_token_ids[0] must be <= 2147483647" in errors["f"]


# --- the Python API -------------------------------------------------------------------------------


def test_generate_gives_each_hostile_request_one_error_row(llm):
    requests = [r for r, _ in ENGINE_ROWS]
    results = llm.generate_list(requests, SamplingParams(max_tokens=3, temperature=0))
    check_answers(results, {r["id"]: fragment for r, fragment in ENGINE_ROWS})
    # content parts are the text the template gets: joined by a newline, as the same string would be
    parts = next(r for r in results if r["id"] == "c1")
    [same] = llm.generate_list([{"id": "s", "messages": [{"role": "user", "content": "the quick\nbrown fox"}]}],
                               SamplingParams(max_tokens=3, temperature=0))
    assert (parts["prompt_tokens"], parts["output_token_ids"]) == (same["prompt_tokens"], same["output_token_ids"])


def test_a_job_default_past_the_ranges_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="top_k must be <= 2147483647"):
        SamplingParams(top_k=10**20)
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] must be >= 0"):
        SamplingParams(stop_token_ids=[1, -3])
    with pytest.raises(ValueError, match=r"stop\[1\] is not valid Unicode"):
        SamplingParams(stop=["ok", "\ud800"])


def test_a_job_default_stop_token_outside_the_vocabulary_fails_each_row_alone(llm):
    results = llm.generate_list([{"id": 1, "prompt": "hi"}, {"id": 2, "prompt": "the"}],
                                SamplingParams(max_tokens=2, stop_token_ids=[VOCAB]))
    assert [r["error"] for r in results] == [f"stop_token_ids[0] is {VOCAB}, outside the vocabulary [0, {VOCAB})"] * 2


def test_a_text_the_tokenizer_fails_on_is_charged_to_its_row_alone(llm, monkeypatch):
    """Fault injection: the real tokenizer, made to raise for one text, as a tokenizer may for an input
    it cannot encode. The batched call fails; each row is then tokenized alone."""
    tokenizer_type = type(llm.engine.tokenizer)
    real_call = tokenizer_type.__call__

    def failing_on_one(self, text, *args, **kwargs):
        if any("poison" in t for t in ([text] if isinstance(text, str) else text)):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        return real_call(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", failing_on_one)
    requests = [{"id": i, "prompt": "poison" if i == 2 else f"the quick brown fox {i}"} for i in range(5)]
    results = llm.generate_list(requests, SamplingParams(max_tokens=2, temperature=0))
    assert results[2]["error"] == ("prompt could not be tokenized: TypeError: TextEncodeInput must be "
                                   "Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
    assert all(r["error"] is None and len(r["output_token_ids"]) == 2 for i, r in enumerate(results) if i != 2)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(llm, monkeypatch):
    """A prompt (or messages) longer than max_len x the longest token cannot fit: refused by its length
    alone. The tokenizer and the template never see it; memory stays at the prompt's own size."""
    from batchgen.engine.request import longest_token_chars

    max_len = llm.engine.max_request_len
    limit = max_len * longest_token_chars(llm.engine.tokenizer)
    seen = []
    tokenizer_type = type(llm.engine.tokenizer)
    real_call, real_template = tokenizer_type.__call__, tokenizer_type.apply_chat_template

    def recording_call(self, text, *args, **kwargs):
        seen.extend([text] if isinstance(text, str) else text)
        return real_call(self, text, *args, **kwargs)

    def recording_template(self, messages, *args, **kwargs):
        seen.extend(m.get("content") or "" for m in messages)
        return real_template(self, messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", recording_call)
    monkeypatch.setattr(tokenizer_type, "apply_chat_template", recording_template)
    huge = "the quick brown fox " * 150_000  # 3 MB
    requests = [{"id": "p", "prompt": huge}, {"id": "m", "messages": [{"role": "user", "content": huge}]},
                {"id": "ok", "prompt": "the quick brown fox"}]
    results = {r["id"]: r for r in llm.generate_list(requests, SamplingParams(max_tokens=2, temperature=0))}
    assert results["p"]["error"] == (
        f"prompt is too long: {len(huge)} characters cannot fit in the limit of {max_len} tokens (max model length "
        f"or KV pool), at most {limit // max_len} characters a token; shorten it")
    assert results["m"]["error"].startswith(f"messages is too long: {len(huge)} characters")
    assert results["ok"]["error"] is None
    assert seen and max(map(len, seen)) < 100  # only the short prompt was tokenized


def test_a_grammar_that_matches_nothing_is_an_error_row_not_a_rejected_token(llm):
    requests = [{"id": "loop", "prompt": "hi", "structured_outputs": {"grammar": "root ::= root"}},
                {"id": "ok", "prompt": "hi", "structured_outputs": {"choice": ["yes", "no"]}}]
    results = {r["id"]: r for r in llm.generate_list(requests, SamplingParams(max_tokens=4, temperature=0))}
    assert results["loop"]["error"] == ("structured_outputs.grammar: no output can match this grammar (a rule that "
                                        "only refers to itself?)")
    assert results["ok"]["text"] in ("yes", "no")


@pytest.mark.parametrize("schema, fragment", [
    ({"$ref": "#"}, "$ref '#' at the root (#) refers back to itself through references alone"),
    ({"properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}}, "refers back to itself"),
    ({"$ref": "file:///etc/schema.json"}, "$ref 'file:///etc/schema.json' at the root (#) is not supported"),
    ({"items": [{"$ref": "other.json#/a"}]}, "$ref 'other.json#/a' at #/items/0 is not supported"),
    ({"$defs": {"n": {"$anchor": "n"}}, "$ref": "#n"}, "$ref '#n' at the root (#) is not supported"),
    ({"properties": {"a": {"$ref": "#/$defs/B"}}, "$defs": {}}, "$ref '#/$defs/B' at #/properties/a points to nothing"),
    ({"properties": {"a": {"$dynamicRef": "#node"}}}, "$dynamicRef at #/properties/a is not supported"),
])
def test_refs_that_xgrammar_would_ignore_or_never_end_are_refused(schema, fragment):
    with pytest.raises(FieldError) as refused:
        check_structured({"structured_outputs": {"json": schema}})
    assert str(refused.value) == f"structured_outputs.json: {fragment}" or fragment in str(refused.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"child": {"$ref": "#"}}},  # a tree: recursion with an end
    {"properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "integer"}}},
    {"properties": {"a~b/c": {"type": "string"}, "x": {"$ref": "#/properties/a~0b~1c"}}},
    {"properties": {"$ref": {"type": "string"}}, "default": {"$ref": "http://data.example"}},  # names and data
])
def test_refs_within_the_schema_are_taken(schema):
    assert check_structured({"structured_outputs": {"json": schema}}).kind == "json"


# --- the queue ------------------------------------------------------------------------------------


class ServingWorker(Running):
    """tests.test_queue's Running, serving the real engine with the job's sampling defaults."""

    def __init__(self, client, keys, llm, sampling: SamplingParams) -> None:  # noqa: F811
        self.worker = Worker(client, keys, llm, sampling, WorkerConfig(consumer="w1", block_ms=50),
                             WorkerMetrics(llm), {"model": "tiny"})
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()


def test_submit_and_a_worker_give_each_hostile_row_one_result(tmp_path, client, keys, chat_model, llm):  # noqa: F811
    rows = [r for r, _ in ENGINE_ROWS + FILE_ROWS]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    submitted = submit_job(client, keys, "j", src)  # no traceback: bad rows are error results at once
    assert submitted.queued + submitted.errors == len(rows)
    # a producer of its own puts requests that submit would have refused straight onto the stream
    foreign = [{"id": "x1", "prompt": "hi", "note": "\ud800"}, {"id": "\udc00", "prompt": "hi"},
               {"id": "x3", "prompt": "\ud800"}, {"id": "x4", "prompt": "the quick brown fox"}]
    for i, request in enumerate(foreign):
        client.xadd(keys.requests, {"job": "j", "index": str(len(rows) + i), "request": json.dumps(request)})
    client.hset(keys.job("j"), mapping={"rows": len(rows) + len(foreign), "submitted": len(rows) + len(foreign)})
    worker = ServingWorker(client, keys, llm, SamplingParams(max_tokens=3, temperature=0))
    wait_for(lambda: client.xlen(keys.results("j")) == len(rows) + len(foreign), timeout=300, what="every result")
    counts = worker.stop()
    assert counts["engine_failures"] == 0  # no in-flight batch went back to the stream for a bad row
    answers = {a["index"]: a["row"] for a in results(client, keys, "j")}
    assert sorted(answers) == list(range(len(rows) + len(foreign)))
    for i, (_, fragment) in enumerate(ENGINE_ROWS + FILE_ROWS):
        error = answers[i]["error"]
        assert (error is None) if fragment is None else (fragment in error), (i, error)
    errors = [answers[len(rows) + i]["error"] for i in range(len(foreign))]
    assert errors[0] == "column note is not valid Unicode: lone surrogate at character 0"
    assert "id is not valid Unicode: lone surrogate at character 0" in errors[1]
    assert errors[2] == "prompt is not valid Unicode: lone surrogate at character 0"
    assert errors[3] is None
    out = tmp_path / "out.parquet"
    collected = collect_job(client, keys, "j", out, timeout_s=10)
    assert collected.metadata["rows"] == len(rows) + len(foreign) == pq.read_metadata(out).num_rows
