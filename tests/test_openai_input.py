"""OpenAI batch input lines -> batchgen rows (batchgen.io.openai_input): fast, no model."""

from __future__ import annotations

import json

import pytest

from batchgen.io.openai_input import (
    CHAT_URL,
    COMPLETIONS_URL,
    OpenAIRowChecker,
    detect_jsonl_format,
    resolve_input_format,
)
from batchgen.io.rows import ROW_KEY, InputRow
from batchgen.io.sources import open_source
from tests.openai_types import line

SERVED = ["SmolLM2-135M-Instruct", "smol"]


def chat(custom_id="c", **body) -> dict:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return line(custom_id, CHAT_URL, **body)


def completion(custom_id="p", **body) -> dict:
    body.setdefault("prompt", "Once upon a time")
    return line(custom_id, COMPLETIONS_URL, **body)


def check(*lines, served=SERVED) -> list[tuple[dict | None, dict | None]]:
    checker = OpenAIRowChecker(served)
    return [checker.check(line if isinstance(line, InputRow) else InputRow(i, line)) for i, line in enumerate(lines)]


def request(line, served=SERVED) -> dict:
    (req, error), = check(line, served=served)
    assert error is None, error["error"]
    return req


def error(line, served=SERVED) -> str:
    (req, err), = check(line, served=served)
    assert req is None, req
    return err["error"]


def test_a_chat_line_maps_to_a_messages_row_with_its_sampling_fields():
    row = request(chat("q1", model="smol", max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3,
                       stop="\n", top_k=20, min_tokens=1, ignore_eos=False, stop_token_ids=[2], logprobs=True,
                       n=1, stream=False, user="u-1", frequency_penalty=0.5, presence_penalty=0.0, metadata={"a": "b"},
                       repetition_penalty=1.1, min_p=0.05, logit_bias={"50": -1}, skip_special_tokens=False,
                       response_format={"type": "text"}))
    expected = {
        "id": "q1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "seed": 3, "stop": ["\n"], "top_k": 20, "min_tokens": 1, "ignore_eos": False,
        "stop_token_ids": [2], "logprobs": True, "url": CHAT_URL, "model": "smol", ROW_KEY: 0,
        "frequency_penalty": 0.5, "presence_penalty": 0.0, "repetition_penalty": 1.1, "min_p": 0.05,
        "logit_bias": {50: -1.0}, "skip_special_tokens": False,
        "n": 1,  # n given: it beats the job's --n
        "response_format": {"type": "text"},  # kept: it opts the line out of a job-wide --response-format
    }
    assert row == expected


def test_a_completion_line_takes_a_string_token_ids_or_a_list_of_one_prompt():
    assert request(completion(prompt="Hello", max_tokens=4))["prompt"] == "Hello"
    assert request(completion(prompt=[1, 2, 3]))["prompt_token_ids"] == [1, 2, 3]
    assert request(completion(prompt=["Hello"]))["prompt"] == "Hello"
    assert request(completion(prompt=[[5, 6]]))["prompt_token_ids"] == [5, 6]
    row = request(completion(prompt="Hi", logprobs=0, echo=False, best_of=1))
    assert row["logprobs"] is True and "top_logprobs" not in row and row["url"] == COMPLETIONS_URL
    assert "max_tokens" not in row  # the job's --max-tokens applies
    assert error(completion(prompt=["a", "b"])) == "body.prompt holds 2 prompts; batchgen takes one prompt per line"


def test_the_model_defaults_to_the_first_served_name_and_any_model_passes_when_none_is_served():
    assert request(chat())["model"] == "SmolLM2-135M-Instruct"
    message = error(chat(model="gpt-4o"))
    assert "body.model 'gpt-4o' is not served here" in message and "--served-model-name gpt-4o" in message
    assert request(chat(model="gpt-4o"), served=None)["model"] == "gpt-4o"
    assert "model" not in {k for k, v in request(chat(), served=None).items() if v is not None}


def test_text_content_parts_are_joined_other_parts_refused_and_developer_is_system():
    parts = [{"type": "text", "text": "Line one"}, {"type": "text", "text": "line two"}]
    row = request(chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]))
    assert row["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Line one\nline two"}]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    assert "body.messages[0].content[0] is not a text part (type 'image_url')" in error(
        chat(messages=[{"role": "user", "content": image}]))


def test_logprobs_map_from_both_endpoints_shapes():
    """Chat: logprobs (bool) + top_logprobs (k); completions: logprobs (k). Both -> logprobs: true and,
    for k > 0, top_logprobs: k."""
    cases = [(chat(logprobs=True, top_logprobs=3), 3), (completion(logprobs=2), 2)]
    for given, k in cases:
        row = request(given)
        assert row["logprobs"] is True and row["top_logprobs"] == k
    assert request(chat(logprobs=True, top_logprobs=0))["logprobs"] is True
    assert "logprobs" not in request(chat(logprobs=False))
    assert error(chat(top_logprobs=2)) == "body.top_logprobs needs body.logprobs: true"
    assert error(chat(logprobs=True, top_logprobs=21)) == "body.top_logprobs must be in [0, 20], got 21"
    assert error(completion(logprobs=True)) == "body.logprobs must be an integer, got bool"
    assert error(chat(logprobs=1)) == "body.logprobs must be true or false, got int"


def test_n_response_format_and_structured_outputs_pass_through():
    for given, field, value in [(chat(n=3), "n", 3), (completion(n=2, best_of=2), "n", 2),
                                (chat(response_format={"type": "json_object"}), "response_format",
                                 {"type": "json_object"}),
                                (completion(structured_outputs={"regex": "[ab]+"}), "structured_outputs",
                                 {"regex": "[ab]+"})]:
        assert request(given)[field] == value
    assert error(chat(n=0)) == "body.n must be >= 1, got 0"
    assert error(completion(n=2, best_of=3)) == "body.best_of must equal n (batchgen returns every sample)"
    assert error(chat(response_format="json")) == "body.response_format must be an object, got str"
    # a client's default text format beside vLLM's constraint: the constraint holds
    both = request(chat(response_format={"type": "text"}, structured_outputs={"regex": "[ab]+"}))
    assert both["structured_outputs"] == {"regex": "[ab]+"} and "response_format" not in both


@pytest.mark.parametrize("line, fragment", [
    (chat(foo=1, bar=2), "unknown body field bar, foo for /v1/chat/completions"),
    (completion(max_completion_tokens=4), "unknown body field max_completion_tokens for /v1/completions"),
    (chat(stream=True), "body.stream: true is not supported in a batch file"),
    (chat(frequency_penalty="x"), "frequency_penalty must be a number, got str"),
    (chat(logit_bias={"50": 101}), "logit_bias['50'] must be in [-100, 100], got 101.0"),
    (chat(tools=[{"type": "function"}]), "body.tools"),
    (completion(echo=True), "body.echo true is not supported"),
    (chat(stream=0), "body.stream 0 is not supported"),
    (chat(max_tokens=5, max_completion_tokens=6), "body.max_tokens and body.max_completion_tokens differ"),
    (chat(max_completion_tokens="5"), "body.max_completion_tokens must be an integer, got str"),
    (chat(temperature="hot"), "temperature must be a number, got str"),
    (chat(messages="Hi"), "messages must be a list"),
    (chat(messages=None), "body.messages is missing"),
    (completion(prompt=None), "body.prompt is missing"),
    (completion(prompt={"text": "x"}), "body.prompt must be a string or a list of token ids, got dict"),
    (completion(prompt=[1, "a"]), "prompt_token_ids[1] must be an integer"),
    (chat(model=5), "body.model must be a string, got int"),
    ({**chat(), "method": "GET"}, 'method must be "POST", got "GET"'),
    ({**chat(), "url": "/v1/embeddings"}, 'url "/v1/embeddings" is not supported; use /v1/chat/completions or'),
    ({**chat(), "body": [1]}, "body must be an object, got list"),
    ({**chat(), "extra": 1}, "unknown line field extra"),
])
def test_bad_lines_become_error_rows_naming_the_field(line, fragment):
    message = error(line)
    assert fragment in message and "\n" not in message


def test_custom_id_must_be_a_unique_string_and_lines_without_one_have_a_null_id():
    results = check(chat("a"), chat("a"), {"method": "POST", "url": CHAT_URL, "body": {}}, chat(7), chat(""),
                    InputRow(5, None, "not JSON: Expecting value at column 1"), InputRow(6, [1, 2]))
    assert results[0][1] is None and results[0][0]["id"] == "a"
    errors = [(e["id"], e["error"], e[ROW_KEY]) for _, e in results[1:]]
    assert errors == [
        (None, "custom_id 'a' already seen in this input (line 2)", 1),
        (None, "custom_id is missing (line 3)", 2),
        (None, "custom_id must be a string, got int (line 4)", 3),
        (None, "custom_id is empty (line 5)", 4),
        (None, "not JSON: Expecting value at column 1 (line 6)", 5),
        (None, "not a JSON object, got list (line 7)", 6),
    ]
    bad_body = check(chat("x", foo=1))[0][1]
    assert (bad_body["id"], bad_body["url"], bad_body["finish_reason"]) == ("x", CHAT_URL, "error")


def test_detection_by_the_first_json_object_line_and_forcing_a_format(tmp_path):
    openai = tmp_path / "batch.jsonl"
    openai.write_text("\n{not json\n" + json.dumps(chat()) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    native = tmp_path / "rows.jsonl"
    native.write_text(json.dumps({"id": 1, "prompt": "x", "body": "carried", "custom_id": "k"}) + "\n")
    assert detect_jsonl_format(openai) == "openai" and detect_jsonl_format(native) == "batchgen"
    assert resolve_input_format(native, "openai") == "openai"
    assert resolve_input_format(openai, "batchgen") == "batchgen"
    parquet = tmp_path / "rows.parquet"
    assert resolve_input_format(parquet, "auto") == "batchgen"
    with pytest.raises(ValueError, match="an OpenAI batch file is JSONL"):
        resolve_input_format(parquet, "openai")
    # the rows of an OpenAI file keep their line numbers as indices, blank lines included
    assert [r.index for r in open_source(openai)] == [1, 2, 3]
