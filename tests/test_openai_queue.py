"""OpenAI batch files through the Redis queue: submit reads them, collect writes the OpenAI output file
(a real redis-server, the queue tests' stand-in engine: fast, no model). Usage errors of the options."""

from __future__ import annotations

import json

import pytest

from batchgen.queue import Keys, collect_job, submit_job
from tests.openai_types import validate_line
from tests.redis_server import prefix, redis_server  # noqa: F401
from tests.test_queue import Running, StandInLLM, client, keys, results, wait_for, write_jsonl  # noqa: F401

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_submit_an_openai_file_and_collect_the_openai_output(tmp_path, client, keys):  # noqa: F811
    lines = [
        line("a", COMPLETIONS, prompt="abc", max_tokens=3, model="served"),
        line("b", COMPLETIONS, prompt="xyz", user="me"),
        line("c", CHAT, messages=[{"role": "user", "content": "hi"}], stream=True),
        line("d", COMPLETIONS, prompt="q", model="other"),
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    submitted = submit_job(client, keys, "j", src, served_models=["served"])
    assert (submitted.queued, submitted.errors) == (2, 2)
    errors = {r["row"]["id"]: r["row"]["error"] for r in results(client, keys, "j")}
    assert errors == {"c": "body.stream: true is not supported in a batch file",
                      "d": "body.model 'other' is not served here (serving 'served'); "
                           "pass --served-model-name other to accept it"}
    running = Running(client, keys, StandInLLM())
    wait_for(lambda: client.xlen(keys.results("j")) == 4, what="4 results")
    running.stop()

    out, error_file = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    collected = collect_job(client, keys, "j", out, timeout_s=10, output_format="openai", error_file=error_file)
    assert collected.metadata["rows"] == 4
    ok = {x["custom_id"]: validate_line(x) for x in map(json.loads, out.read_text().splitlines())}
    assert set(ok) == {"a", "b"}
    assert ok["a"].choices[0].text == "cba" and ok["a"].object == "text_completion" and ok["a"].model == "served"
    failed = [json.loads(x) for x in error_file.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in failed) == ["c", "d"] and all(validate_line(x) is None for x in failed)


@pytest.mark.parametrize("args, option", [
    (["run", "{src}", "out.parquet", "--error-file", "e.jsonl"], "--error-file"),
    (["run", "{src}", "out.jsonl", "--error-file", "out.jsonl"], "--error-file"),
    (["run", "{parquet}", "out.jsonl", "--input-format", "openai"], "--input-format"),
    (["run", "{src}", "out.jsonl", "--output-format", "csv"], "--output-format"),
    (["run", "{src}", "out.jsonl", "--served-model-name", ""], "--served-model-name"),
    (["submit", "{parquet}", "--redis-url", "redis://127.0.0.1:1", "--job", "j", "--input-format", "openai"],
     "--input-format"),
    (["collect", "out.parquet", "--redis-url", "redis://127.0.0.1:1", "--job", "j", "--error-file", "e.jsonl"],
     "--error-file"),
])
def test_format_options_usage_errors_are_one_line(tmp_path, batchgen, monkeypatch, args, option):
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", [line("a", COMPLETIONS, prompt="x")])
    parquet = tmp_path / "in.parquet"
    parquet.write_bytes(b"PAR1")
    code, _, err = batchgen(*(a.format(src=src, parquet=parquet) for a in args))
    assert code == 2 and len(err.strip().splitlines()) == 1 and option in err, err
