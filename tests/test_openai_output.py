"""The OpenAI batch output file from a job's part files (batchgen.io.openai_output): fast, no model.

The parts are written by the Parquet sink as a job writes them, holding rows as the engine gives them:
with `sample_index` for n samples and `top_logprobs` structs where the rows asked for them.
"""

from __future__ import annotations

import math
import os

from batchgen.io.layout import Layout
from batchgen.io.openai_input import CHAT_URL, COMPLETIONS_URL
from batchgen.io.openai_output import sidecar_path, stored_fingerprint, stored_metadata, write_openai_output
from batchgen.io.parts import PartWriter
from batchgen.io.rows import ROW_KEY
from batchgen.schema import error_result
from tests.openai_types import read_lines, validate_line


def result(index: int, custom_id, url: str, text: str, tokens: list[int], **fields) -> dict:
    row = {"id": custom_id, "url": url, "model": "smol", "text": text, "output_token_ids": tokens,
           "finish_reason": "stop", "error": None, "prompt_tokens": 5, "completion_tokens": len(tokens),
           "cached_prompt_tokens": 0, "num_preemptions": 0, "queue_s": 0.0, "ttft_s": 0.1, "prefill_s": 0.1,
           "decode_s": 0.2, "e2e_s": 0.3, "decode_tokens_per_s": 10.0, ROW_KEY: index}
    row.update(fields)
    return row


def alternatives(*pairs) -> list[dict]:
    return [{"token_id": t, "token": s, "logprob": lp} for t, s, lp in pairs]


def write_parts(workdir, *parts: list[dict]) -> None:
    writer = PartWriter(workdir, Layout(None), flush_rows=10**6, flush_seconds=float("inf"))
    for rows in parts:
        for row in rows:
            writer.add(row)
        writer.flush()


def write(tmp_path, *parts, error_file=None, token_text=lambda t: f"<{t}>"):
    workdir = tmp_path / "out.jsonl.partial"
    workdir.mkdir()
    write_parts(workdir, *parts)
    seen = {}

    def metadata(totals):
        seen["totals"] = totals
        return {"fingerprint": {"job": 1}, "rows": totals.rows}

    output = tmp_path / "out.jsonl"
    write_openai_output(workdir, output, metadata, served_model="served", salt="job-1", token_text=token_text,
                        error_file=error_file)
    return output, seen["totals"]


def test_lines_validate_against_the_sdk_with_samples_grouped_across_parts_and_each_row_once(tmp_path):
    first_sample = result(0, "q", CHAT_URL, "Paris.", [11, 12], sample_index=0, cached_prompt_tokens=3)
    second_sample = result(0, "q", CHAT_URL, "It is Paris", [13, 14, 15], sample_index=1, cached_prompt_tokens=2,
                           finish_reason="length")
    completion = result(1, "p", COMPLETIONS_URL, " a cat", [21, 22], logprobs=[-0.5, -float("inf")],
                        top_logprobs=[alternatives((21, " a", -0.5), (30, " the", -1.0)),
                                      alternatives((31, " dog", -0.1))])
    failed = error_result(None, "custom_id is missing (line 3)", {"url": CHAT_URL, "model": None})
    failed[ROW_KEY] = 2
    chat_logprobs = result(3, "c", CHAT_URL, "Olá", [41, 42], logprobs=[-0.25, -0.75], model=None)
    resumed_again = {**completion, "text": "a second copy"}  # a row saved twice (kept once: the first)
    output, totals = write(tmp_path, [first_sample, completion, failed], [chat_logprobs, second_sample, resumed_again])

    lines = read_lines(output)
    assert len(lines) == 4 and sorted(str(line["custom_id"]) for line in lines) == ["None", "c", "p", "q"]
    by_id = {line["custom_id"]: line for line in lines}
    parsed = {custom_id: validate_line(line) for custom_id, line in by_id.items()}
    assert (totals.rows, totals.rows_error) == (4, 1)  # lines, not samples: q has two

    chat = parsed["q"]
    assert chat.object == "chat.completion" and chat.model == "smol"
    assert [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == [
        (0, "Paris.", "stop"), (1, "It is Paris", "length")]
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (5, 5)
    assert chat.usage.prompt_tokens_details.cached_tokens == 2 and chat.choices[0].logprobs is None

    text = parsed["p"]
    assert text.object == "text_completion" and text.choices[0].text == " a cat"
    logprobs = text.choices[0].logprobs
    assert logprobs.tokens == [" a", "<22>"]  # the engine's token text where it has one, else the tokenizer's
    assert logprobs.token_logprobs == [-0.5, -9999.0]
    assert logprobs.top_logprobs == [{" a": -0.5, " the": -1.0}, {" dog": -0.1}]
    assert logprobs.text_offset == [0, 2]

    content = parsed["c"].choices[0].logprobs.content
    assert parsed["c"].model == "served"  # the row recorded no model
    assert [(t.token, t.bytes, t.logprob, t.top_logprobs) for t in content] == [
        ("<41>", list(b"<41>"), -0.25, []), ("<42>", list(b"<42>"), -0.75, [])]

    assert by_id[None]["error"] == {"code": "invalid_request", "message": "custom_id is missing (line 3)"}
    ids = [line["id"] for line in lines] + [line["response"]["request_id"] for line in lines if line["response"]]
    assert len(set(ids)) == len(ids)
    assert not list(output.parent.glob("*.tmp")) and not list((tmp_path / "out.jsonl.partial").glob("*.tmp"))


def test_failed_lines_go_to_the_error_file_when_one_is_given(tmp_path):
    failed = error_result("b", "body.stream: true is not supported in a batch file")
    failed[ROW_KEY] = 1
    error_file = tmp_path / "errors.jsonl"
    output, _ = write(tmp_path, [result(0, "a", CHAT_URL, "ok", [1]), failed], error_file=error_file)
    assert [line["custom_id"] for line in read_lines(output)] == ["a"]
    errors = read_lines(error_file)
    assert [(e["custom_id"], e["response"], e["error"]["message"]) for e in errors] == [
        ("b", None, "body.stream: true is not supported in a batch file")]
    validate_line(errors[0])


def test_without_a_tokenizer_a_token_is_named_by_its_id(tmp_path):
    row = result(0, "a", COMPLETIONS_URL, "x", [7], logprobs=[math.log(0.5)])
    output, _ = write(tmp_path, [row], token_text=None)
    logprobs = validate_line(read_lines(output)[0]).choices[0].logprobs
    assert logprobs.tokens == ["token_id:7"] and logprobs.top_logprobs is None


def test_the_sidecar_holds_the_metadata_and_counts_only_for_the_file_it_was_written_with(tmp_path):
    output, _ = write(tmp_path, [result(0, "a", CHAT_URL, "ok", [1])])
    assert stored_metadata(output) == {"fingerprint": {"job": 1}, "rows": 1}
    assert stored_fingerprint(output) == {"job": 1}
    stat = output.stat()
    os.utime(output, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # another file at OUTPUT since
    assert stored_metadata(output) is None and stored_fingerprint(output) is None
    sidecar_path(output).write_text("{not json")
    assert stored_metadata(output) is None


def test_a_token_the_tokenizer_cannot_spell_is_named_by_its_id(tmp_path):
    def token_text(token_id):
        if token_id > 100:
            raise IndexError("out of the vocabulary")
        return "ok"

    output, _ = write(tmp_path, [result(0, "a", COMPLETIONS_URL, "ok", [7, 500], logprobs=[-1.0, -2.0])],
                      token_text=token_text)
    assert validate_line(read_lines(output)[0]).choices[0].logprobs.tokens == ["ok", "token_id:500"]
