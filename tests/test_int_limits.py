"""Integer limits (issue #45 item 2): one table (schema.INT_RANGES) bounds a row's integer fields, the
job defaults (SamplingParams) and the command-line options of the same names, with the same message;
past it a value is an error row or a one-line usage error, never an overflow deep in the engine."""

from __future__ import annotations

import json

import pytest

from batchgen import SamplingParams
from batchgen.io.openai_input import CHAT_URL, OpenAIRowChecker
from batchgen.io.rows import InputRow, RowChecker
from batchgen.schema import INT_RANGES
from tests.openai_types import line

FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "n", "top_logprobs")


def row_error(data: dict) -> str | None:
    _, error = RowChecker().check(InputRow(0, data))
    return None if error is None else error["error"]


@pytest.mark.parametrize("field", FIELDS)
def test_a_rows_integer_past_its_range_is_an_error_row_and_its_bounds_pass(field):
    low, high = INT_RANGES[field]
    assert row_error({"prompt": "hi", field: high}) is None and row_error({"prompt": "hi", field: low}) is None
    for bad in (high + 1, low - 1, 10**25, float(10**25)):
        error = row_error({"prompt": "hi", field: bad})
        assert error is not None and error.startswith(f"{field} must be ") and f"got {int(bad)}" in error, error


@pytest.mark.parametrize("field", [f for f in FIELDS if f != "top_logprobs"])  # (an output option)
def test_a_job_default_past_the_range_fails_with_the_rows_message(field):
    low, high = INT_RANGES[field]
    for bad in (high + 1, low - 1):
        with pytest.raises(ValueError) as refused:
            SamplingParams(**{field: bad, **({"max_tokens": high} if field == "min_tokens" else {})})
        assert str(refused.value) == row_error({"prompt": "hi", field: bad})


def test_token_ids_and_integer_ids_past_their_ranges_are_error_rows():
    assert row_error({"prompt": "hi", "stop_token_ids": [-3, 10**12]}) == "stop_token_ids[0] must be >= 0, got -3"
    assert row_error({"prompt": "hi", "stop_token_ids": [3, 10**12]}) == \
        "stop_token_ids[1] must be <= 2147483647, got 1000000000000"
    assert row_error({"id": 2**63, "prompt": "hi"}) == "id must be <= 9223372036854775807, got 9223372036854775808"
    assert row_error({"id": -(2**63), "prompt": "hi"}) is None
    assert row_error({"id": 1e25, "prompt": "hi"}).startswith("id must be <= 9223372036854775807")


def test_openai_body_integers_past_their_ranges_are_error_lines():
    checker = OpenAIRowChecker(None)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [({"top_k": 1e25}, "top_k must be <= 2147483647"), ({"max_tokens": 10**20}, "max_tokens must be <= "),
             ({"n": 10**20}, "n must be in [1, 1024]"), ({"seed": -1}, "seed must be >= 0"),
             ({"min_tokens": 2**31}, "min_tokens must be <= 2147483647")]
    for i, (fields, fragment) in enumerate(cases):
        _, error = checker.check(InputRow(i, line(f"c{i}", CHAT_URL, **body, **fields), unit="line"))
        assert error is not None and fragment in error["error"], (fields, error and error["error"])


@pytest.mark.parametrize("option, value, message", [
    ("--top-k", 10**20, "top_k must be <= 2147483647, got 100000000000000000000"),
    ("--max-tokens", 10**20, "max_tokens must be <= 2147483647"),
    ("--min-tokens", 2**31, "min_tokens must be <= 2147483647"),
    ("--n", 10**20, "n must be in [1, 1024]"),
    ("--seed", 10**20, "seed must be <= 9223372036854775807"),
    ("--seed", -1, "seed must be >= 0"),
    ("--max-num-seqs", 10**20, "--max-num-seqs"),
    ("--max-model-len", 10**20, "--max-model-len"),
    ("--kv-cache-tokens", 10**20, "--kv-cache-tokens"),
    ("--max-num-batched-tokens", 0, "invalid --max-num-batched-tokens: must be >= 1, got 0"),
])
def test_options_past_the_ranges_are_one_line_usage_errors(batchgen, tiny_model, tmp_path, option, value, message):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    done = batchgen("run", src, tmp_path / "out" / "o.parquet", "--model", tiny_model("llama"), "--max-tokens", "2",
                    option, str(value))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgen: error:") and message in lines[0], done.stderr
    assert not (tmp_path / "out").exists()
