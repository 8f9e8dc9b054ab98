"""OpenAI batch files through the commands, in this process: submit reads them and collect writes the
OpenAI output (a real redis-server, the queue tests' stand-in engine), run from a native input to the
OpenAI output (a tiny model), usage errors of the format options."""

from __future__ import annotations

import json

import pytest

from batchgen.io.openai_input import CHAT_URL, COMPLETIONS_URL
from batchgen.queue import Keys, collect_job, submit_job
from tests.openai_types import line, read_lines, validate_line
from tests.redis_server import prefix, redis_server  # noqa: F401
from tests.test_queue import Running, StandInLLM, client, keys, results, wait_for, write_jsonl  # noqa: F401


def test_submit_an_openai_file_and_collect_the_openai_output(tmp_path, client, keys):  # noqa: F811
    lines = [
        line("a", COMPLETIONS_URL, prompt="abc", max_tokens=3, model="served"),
        line("b", COMPLETIONS_URL, prompt="xyz", user="me"),
        line("c", CHAT_URL, messages=[{"role": "user", "content": "hi"}], stream=True),
        line("d", COMPLETIONS_URL, prompt="q", model="other"),
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
    ok = {x["custom_id"]: validate_line(x) for x in read_lines(out)}
    assert set(ok) == {"a", "b"}
    assert ok["a"].choices[0].text == "cba" and ok["a"].object == "text_completion" and ok["a"].model == "served"
    failed = read_lines(error_file)
    assert sorted(x["custom_id"] for x in failed) == ["c", "d"] and all(validate_line(x) is None for x in failed)


@pytest.mark.parametrize("args, option", [
    (["run", "{src}", "out.parquet", "--error-file", "e.jsonl"], "--error-file"),
    (["run", "{src}", "out.jsonl", "--error-file", "out.jsonl"], "--error-file"),
    (["run", "{src}", "out.jsonl", "--error-file", "out.jsonl.batchgen.json"], "--error-file"),  # (the metadata)
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
    src = write_jsonl(tmp_path / "in.jsonl", [line("a", COMPLETIONS_URL, prompt="x")])
    parquet = tmp_path / "in.parquet"
    parquet.write_bytes(b"PAR1")
    code, _, err = batchgen(*(a.format(src=src, parquet=parquet) for a in args))
    assert code == 2 and len(err.strip().splitlines()) == 1 and option in err, err


@pytest.mark.slow  # loads the default model's tokenizer (converting the model once if needed)
def test_collect_spells_logprob_tokens_with_the_tokenizer_it_is_given(tmp_path, redis_server, prefix, batchgen,
                                                                      client):  # noqa: F811
    from transformers import AutoTokenizer

    from batchgen.models.resolve import resolve_model_dir
    from batchgen.queue.protocol import encode_result

    keys = Keys(prefix)
    src = write_jsonl(tmp_path / "batch.jsonl", [line("a", COMPLETIONS_URL, prompt="Say hi", logprobs=0)])
    submit_job(client, keys, "j", src)
    (msg_id, fields), = client.xreadgroup("workers", "w", {keys.requests: ">"})[0][1]
    request = json.loads(fields[b"request"])
    ids = AutoTokenizer.from_pretrained(resolve_model_dir(None))(" Hello there").input_ids
    answer = {"id": request["id"], "url": request["url"], "model": request["model"], "text": " Hello there",
              "output_token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop", "error": None,
              "prompt_tokens": 2, "completion_tokens": len(ids), "cached_prompt_tokens": 0}
    result = encode_result(msg_id.decode(), 0, "w", answer)
    client.xadd(keys.results("j"), dict(zip(result[::2], result[1::2])))

    out = tmp_path / "out.jsonl"
    args = ["--redis-url", redis_server.url(), "--prefix", prefix, "--job", "j", "--timeout", "10"]
    code, _, err = batchgen("collect", out, *args, "--tokenizer", "default")
    assert code == 0, err
    body = validate_line(json.loads(out.read_text()))
    assert "".join(body.choices[0].logprobs.tokens) == " Hello there"
    code, _, err = batchgen("collect", tmp_path / "out2.jsonl", *args)
    assert code == 0, err
    assert validate_line(json.loads((tmp_path / "out2.jsonl").read_text())).choices[0].logprobs.tokens == [
        f"token_id:{t}" for t in ids]
    code, _, err = batchgen("collect", tmp_path / "out3.jsonl", *args, "--tokenizer", str(tmp_path / "none"))
    assert code == 2 and "--tokenizer" in err and len(err.strip().splitlines()) == 1, err


def test_a_native_input_to_the_openai_output_on_a_tiny_model(tmp_path, batchgen, tiny_model):
    """Rows of batchgen's own format answered as OpenAI lines: prompt rows as text_completion, the
    model named by --model (the default served name), tokens spelled by the model's tokenizer."""
    model = tiny_model("llama")
    src = write_jsonl(tmp_path / "rows.jsonl", [
        {"id": 1, "prompt": "the quick brown", "max_tokens": 3},
        {"id": "x", "prompt_token_ids": [5, 6, 7], "max_tokens": 4, "logprobs": True, "ignore_eos": True},
        {"id": "m", "messages": [{"role": "user", "content": "hi"}]},  # the tiny tokenizer has no chat template
    ])
    out = tmp_path / "out.txt"
    code, stdout, err = batchgen("run", src, out, "--model", model, "--output-format", "openai",
                                 "--temperature", "0", "--device", "cpu")
    assert code == 0, err
    lines = {x["custom_id"]: x for x in read_lines(out)}
    assert set(lines) == {"1", "x", "m"} and "2 ok, 1 errors" in stdout
    bodies = {k: validate_line(v) for k, v in lines.items()}
    assert bodies["m"] is None and "chat template" in lines["m"]["error"]["message"]
    assert bodies["1"].object == "text_completion" and bodies["1"].model == str(model)
    logprobs = bodies["x"].choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert "".join(logprobs.tokens).startswith(bodies["x"].choices[0].text)  # ASCII tokens: their texts join up
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(4)]
