"""`batchgen run` on OpenAI Batch API files end to end: the real CLI (in a subprocess only where it is
killed; else conftest's in-process `batchgen`, its imports paid once), the real engine, the embedded
default model (its name is the served model name by default). Few lines, few tokens."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchgen.io.openai_input import CHAT_URL, COMPLETIONS_URL
from tests.openai_types import line, read_lines, validate_line
from tests.test_cli_run import killed_after_first_part, write_jsonl

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FP32 = ["--dtype", "float32"]  # greedy texts compared between runs that batch rows differently


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LINES = [
    line("paris", CHAT_URL, model=MODEL, messages=QUESTION, max_completion_tokens=12, temperature=0, logprobs=True,
         stop=["\n\n"], seed=1, stream=False, n=1, user="team-a", response_format={"type": "text"}),
    line("parts", CHAT_URL, messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                  {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
         max_tokens=4, temperature=0),
    line("story", COMPLETIONS_URL, model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=0),
    line("ids", COMPLETIONS_URL, prompt=[1, 504, 3575, 282], max_tokens=3, temperature=0, stop="\n"),
    line("nested", COMPLETIONS_URL, prompt=[[1, 504, 3575]], max_tokens=2, temperature=0, echo=False),
]


def test_an_openai_batch_file_gives_a_file_that_the_openai_sdk_reads(batchgen, tmp_path):
    src = write_jsonl(tmp_path / "batch.jsonl", LINES)
    out = tmp_path / "results.jsonl"
    done = batchgen("run", src, out, *FP32, "--log-every", "0")
    assert done.returncode == 0, done.stderr
    assert f"done: {len(LINES)} rows ({len(LINES)} ok, 0 errors)" in done.stdout
    lines = read_lines(out)
    assert sorted(x["custom_id"] for x in lines) == sorted(x["custom_id"] for x in LINES)
    bodies = {x["custom_id"]: validate_line(x) for x in lines}
    for request in LINES:
        body = bodies[request["custom_id"]]
        chat = request["url"] == CHAT_URL
        assert body.object == ("chat.completion" if chat else "text_completion") and body.model == MODEL
        assert len(body.choices) == 1 and body.usage.prompt_tokens > 0
        limit = request["body"].get("max_completion_tokens") or request["body"]["max_tokens"]
        assert 0 < body.usage.completion_tokens <= limit
        assert body.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in bodies["paris"].choices[0].message.content
    content = bodies["paris"].choices[0].logprobs.content
    assert len(content) == bodies["paris"].usage.completion_tokens and all(t.logprob <= 0 for t in content)
    assert "Paris" in "".join(t.token for t in content)  # tokens spelled by the model's tokenizer
    story = bodies["story"].choices[0]
    assert "".join(story.logprobs.tokens).startswith(story.text) and story.logprobs.top_logprobs is None
    assert bodies["ids"].usage.prompt_tokens == 4 and bodies["nested"].usage.prompt_tokens == 3
    assert (tmp_path / "results.jsonl.batchgen.json").exists() and not (tmp_path / "results.jsonl.partial").exists()

    again = batchgen("run", src, out, *FP32)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr

    # the same file to Parquet: custom_id as id, url and model as columns, the same texts
    parquet = tmp_path / "results.parquet"
    done = batchgen("run", src, parquet, *FP32)
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in pq.read_table(parquet).to_pylist()}
    assert set(rows) == set(bodies) and rows["story"]["url"] == COMPLETIONS_URL and rows["paris"]["model"] == MODEL
    for custom_id, body in bodies.items():
        choice = body.choices[0]
        assert rows[custom_id]["text"] == (choice.message.content if body.object == "chat.completion" else choice.text)


BAD_LINES = [
    line("good", COMPLETIONS_URL, prompt="Hello", max_tokens=2),
    b"{this is not json",
    {"method": "POST", "url": CHAT_URL, "body": {"messages": QUESTION}},
    line("embed", "/v1/embeddings", input="Hello"),
    {**line("get", CHAT_URL, messages=QUESTION), "method": "GET"},
    line("types", CHAT_URL, messages=QUESTION, max_tokens="many"),
    line("unknown", CHAT_URL, messages=QUESTION, frobnicate=True, tools_extra=1),
    line("stream", CHAT_URL, messages=QUESTION, stream=True),
    line("model", CHAT_URL, model="gpt-4o-mini", messages=QUESTION, max_tokens=2),
    line("good", COMPLETIONS_URL, prompt="Hello again", max_tokens=2),
    line("long", COMPLETIONS_URL, prompt="word " * 100, max_tokens=2),
]


def test_bad_lines_become_error_lines_and_the_job_exits_0(batchgen, tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    out = tmp_path / "out.jsonl"
    done = batchgen("run", src, out, "--max-model-len", "64")
    assert done.returncode == 0, done.stderr
    lines = read_lines(out)
    assert len(lines) == len(BAD_LINES) and f"1 ok, {len(BAD_LINES) - 1} errors" in done.stdout
    for x in lines:
        validate_line(x)
    errors = {(x["custom_id"], x["error"]["message"]) for x in lines if x["error"] is not None}
    expected = [
        (None, "not JSON: Expecting property name enclosed in double quotes at column 2 (line 2)"),
        (None, "custom_id is missing (line 3)"),
        ("embed", 'url "/v1/embeddings" is not supported'),
        ("get", 'method must be "POST", got "GET"'),
        ("types", "body.max_tokens must be an integer, got str"),
        ("unknown", "unknown body field frobnicate, tools_extra for /v1/chat/completions"),
        ("stream", "body.stream: true is not supported in a batch file"),
        ("model", "body.model 'gpt-4o-mini' is not served here (serving 'SmolLM2-135M-Instruct')"),
        (None, "custom_id 'good' already seen in this input (line 10)"),
        ("long", "exceeds the limit of 64 tokens"),
    ]
    for custom_id, fragment in expected:
        assert any(c == custom_id and fragment in m for c, m in errors), (custom_id, fragment, errors)
    assert len(errors) == len(expected)
    good = [x for x in lines if x["custom_id"] == "good" and x["error"] is None]
    assert len(good) == 1 and good[0]["response"]["body"]["choices"][0]["text"]

    # the same job with --error-file: failed lines there, OUTPUT holds the rest
    out2, error_file = tmp_path / "out2.jsonl", tmp_path / "errors.jsonl"
    done = batchgen("run", src, out2, "--max-model-len", "64", "--error-file", error_file,
                    "--served-model-name", "gpt-4o-mini", "--served-model-name", "local")
    assert done.returncode == 0, done.stderr
    assert sorted(x["custom_id"] for x in read_lines(out2)) == ["good", "model"]
    model = next(x for x in read_lines(out2) if x["custom_id"] == "model")
    assert model["response"]["body"]["model"] == "gpt-4o-mini"
    assert len(read_lines(error_file)) == len(BAD_LINES) - 2


KILL_LINES = [line(f"req-{i}", CHAT_URL if i % 2 else COMPLETIONS_URL, max_tokens=8, ignore_eos=True,
                   **({"messages": [{"role": "user", "content": f"Tell me fact number {i}."}]} if i % 2
                      else {"prompt": f"Fact number {i} about the sea:"}))
              for i in range(8)]
KILL_OPTIONS = [*FP32, "--temperature", "0", "--max-num-seqs", "2", "--flush-rows", "1"]


def test_sigkill_mid_job_then_rerun_gives_every_custom_id_exactly_once(batchgen, tmp_path):
    src = write_jsonl(tmp_path / "batch.jsonl", KILL_LINES)
    out = tmp_path / "out.jsonl"
    saved = killed_after_first_part("run", src, out, *KILL_OPTIONS)
    assert not out.exists() and 0 < saved < len(KILL_LINES)

    done = batchgen("run", src, out, *KILL_OPTIONS)
    assert done.returncode == 0, done.stderr
    lines = read_lines(out)
    assert sorted(x["custom_id"] for x in lines) == sorted(x["custom_id"] for x in KILL_LINES)
    assert all(validate_line(x).usage.completion_tokens == 8 for x in lines)
    meta = json.loads((tmp_path / "out.jsonl.batchgen.json").read_text())["batchgen"]
    assert meta["rows_resumed"] >= saved and meta["rows"] == len(KILL_LINES)
    assert meta["fingerprint"]["input_format"] == "openai" and meta["fingerprint"]["output_format"] == "openai"


def test_n_samples_top_logprobs_and_a_json_schema(batchgen, tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    lines = [
        line("n3", CHAT_URL, messages=QUESTION, n=3, max_tokens=4, temperature=1.0, seed=5),
        line("top", CHAT_URL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3),
        line("top-text", COMPLETIONS_URL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2),
        line("json", CHAT_URL, messages=QUESTION, max_tokens=24, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}),
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    done = batchgen("run", src, out, "--log-every", "0")
    assert done.returncode == 0, done.stderr
    bodies = {x["custom_id"]: validate_line(x) for x in read_lines(out)}
    assert set(bodies) == {x["custom_id"] for x in lines}
    n3 = bodies["n3"]
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert 3 <= n3.usage.completion_tokens <= 12  # the samples' tokens summed
    assert n3.usage.prompt_tokens == bodies["top"].usage.prompt_tokens  # the prompt counted once
    for token in bodies["top"].choices[0].logprobs.content:  # greedy: the sampled token is the top one
        assert 1 <= len(token.top_logprobs) <= 3
        assert (token.token, token.logprob) == (token.top_logprobs[0].token,
                                                pytest.approx(token.top_logprobs[0].logprob))
    top_text = bodies["top-text"].choices[0].logprobs
    assert all(len(alternatives) <= 2 for alternatives in top_text.top_logprobs)
    assert "city" in json.loads(bodies["json"].choices[0].message.content)
