"""OpenAI Batch API output files, written from a completed job's part files.

The part files in the work directory stay the storage that resume goes by; when every row is done
they are streamed into one JSONL file of OpenAI batch output lines, written under a temporary name
and renamed to OUTPUT. One line per input line:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": "req_...",
     "body": <a chat.completion or text_completion object>}, "error": null}

A row that failed gets `"response": null, "error": {"code": "invalid_request", "message": ...}`, in
the same file (as vLLM's run-batch does) or, given `error_file`, in that file instead (as OpenAI does).

Rows of one input line may be several (n samples, `sample_index` 0..n-1), saved in any order and in
different parts: the first pass over the parts finds the last part that holds a sample of each
line, the second writes a line as soon as that part is read, so only lines whose samples straddle
parts wait in memory.

A JSONL file has no place for metadata, so the job's metadata (the `batchgen` key of a Parquet
output) goes to a sidecar, OUTPUT.batchgen.json, written just before the rename, with OUTPUT's size
and mtime: a sidecar that does not match OUTPUT (a crash between the two) counts as absent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.openai_input import COMPLETIONS_URL
from batchgen.io.parts import fsync_dir, list_parts, write_atomically, write_error, writing
from batchgen.io.rows import ROW_KEY
from batchgen.io.sinks import Totals, first_copies, per_input_row
from batchgen.token_text import TokenText

SAMPLE_KEY = "sample_index"  # the n samples of one line (absent: one sample, index 0)
ERROR_CODE = "invalid_request"
MIN_LOGPROB = -9999.0  # OpenAI's stand-in for a token too unlikely to have a finite log-probability
OUTPUT_COLUMNS = ("id", "text", "output_token_ids", "finish_reason", "error", "prompt_tokens", "completion_tokens",
                  "cached_prompt_tokens", "logprobs", "top_logprobs", "url", "model", SAMPLE_KEY, ROW_KEY)
OPENAI_SUFFIXES = (".jsonl", ".ndjson")

# --- response objects ---------------------------------------------------------------------------


def _logprob(value: float | None) -> float:
    if value is None or math.isnan(value):
        return MIN_LOGPROB
    return max(float(value), MIN_LOGPROB)


class TokenNames:
    """Token id -> its text: the engine's own (an alternative's `token`), else the tokenizer's, else
    `token_id:ID` (vLLM's spelling when no text is known)."""

    def __init__(self, token_text: TokenText | None) -> None:
        self.token_text = token_text

    def __call__(self, token_id: int, alternatives: list[dict] | None = None) -> str:
        for alt in alternatives or ():
            if alt.get("token_id") == token_id and isinstance(alt.get("token"), str):
                return alt["token"]
        if self.token_text is not None:
            try:
                return self.token_text(token_id)
            except (ValueError, TypeError, IndexError, KeyError, OverflowError):
                pass  # an id the tokenizer does not know (a model whose vocabulary is larger)
        return f"token_id:{token_id}"

    def alternative(self, alt: dict) -> str:
        token = alt.get("token")
        return token if isinstance(token, str) else self(int(alt["token_id"]))


def _token_logprob(token: str, value: float | None) -> dict:
    return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": _logprob(value)}


def _chat_logprobs(sample: dict, names: TokenNames) -> dict | None:
    values = sample.get("logprobs")
    if values is None:
        return None
    # per generated token, its top-k alternatives as {token_id, token, logprob} (layout.TOP_LOGPROB_TYPE)
    tops = sample.get("top_logprobs") or [None] * len(values)
    content = []
    for token_id, value, top in zip(sample["output_token_ids"], values, tops):
        content.append({
            **_token_logprob(names(token_id, top), value),
            "top_logprobs": [_token_logprob(names.alternative(alt), alt.get("logprob")) for alt in top or ()],
        })
    return {"content": content}


def _completion_logprobs(sample: dict, names: TokenNames) -> dict | None:
    values = sample.get("logprobs")
    if values is None:
        return None
    stored_tops = sample.get("top_logprobs")
    tops = stored_tops if stored_tops is not None else [None] * len(values)
    tokens = [names(t, top) for t, top in zip(sample["output_token_ids"], tops)]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(v) for v in values],
        "top_logprobs": None if stored_tops is None else [
            {names.alternative(alt): _logprob(alt.get("logprob")) for alt in top or ()} for top in tops
        ],
        "text_offset": offsets,
    }


def _usage(samples: list[dict]) -> dict:
    """The prompt counts once for n samples (OpenAI's usage); cached: the part of the prompt that
    every sample found in the cache."""
    prompt = int(samples[0]["prompt_tokens"] or 0)
    completion = sum(int(s["completion_tokens"] or 0) for s in samples)
    cached = min(int(s.get("cached_prompt_tokens") or 0) for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response_body(samples: list[dict], model: str, created: int, request_key: str, names: TokenNames) -> dict:
    """The chat.completion (or text_completion, for rows of /v1/completions) of one input line's samples."""
    samples = sorted(samples, key=lambda s: s.get(SAMPLE_KEY) or 0)
    chat = samples[0].get("url") != COMPLETIONS_URL
    choices = []
    for position, sample in enumerate(samples):
        index = sample.get(SAMPLE_KEY)
        choice: dict[str, Any] = {"index": position if index is None else int(index)}
        if chat:
            choice["message"] = {"role": "assistant", "content": sample["text"]}
            choice["logprobs"] = _chat_logprobs(sample, names)
        else:
            choice["text"] = sample["text"]
            choice["logprobs"] = _completion_logprobs(sample, names)
        choice["finish_reason"] = sample["finish_reason"]
        choices.append(choice)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_key}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(samples),
    }


def output_line(samples: list[dict], served_model: str, created: int, request_key: str,
                names: TokenNames) -> tuple[dict, bool]:
    """One input line's OpenAI batch output line -> (line, failed)."""
    first = samples[0]
    custom_id = None if first.get("id") is None else str(first["id"])
    line: dict[str, Any] = {"id": f"batch_req_{request_key}", "custom_id": custom_id}
    failed = next((s for s in samples if s.get("finish_reason") == "error"), None)
    if failed is not None:
        line.update(response=None, error={"code": ERROR_CODE, "message": failed.get("error") or "failed"})
        return line, True
    model = first.get("model") if isinstance(first.get("model"), str) else served_model
    body = response_body(samples, model, created, request_key, names)
    line.update(response={"status_code": 200, "request_id": f"req_{request_key}", "body": body}, error=None)
    return line, False


# --- the final file -----------------------------------------------------------------------------


def is_openai_output(path: Path) -> bool:
    return path.suffix.lower() in OPENAI_SUFFIXES


def sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + ".batchgen.json")


def stored_metadata(output: Path) -> dict | None:
    """The metadata of a finished OpenAI OUTPUT, or None if its sidecar is missing or not OUTPUT's."""
    try:
        stored = json.loads(sidecar_path(output).read_text())
        stat = output.stat()
        if stored["output"] != {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
            return None
        return stored["batchgen"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stored_fingerprint(output: Path) -> dict | None:
    meta = stored_metadata(output)
    return meta.get("fingerprint") if isinstance(meta, dict) else None


def _text_file(path: Path):
    return open(path, "w", encoding="utf-8", newline="\n")


def write_openai_output(
    workdir: Path,
    output: Path,
    metadata: Callable[[Totals], dict],
    served_model: str,
    salt: str,
    token_text: TokenText | None = None,
    error_file: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> Totals:
    """Streams every part into OUTPUT as OpenAI batch output lines, each (line, sample) at most once;
    -> the totals over the rows kept, rows counted as lines. `metadata(totals)` goes to the sidecar; `salt` (the job's
    fingerprint) makes the generated ids differ between jobs while a rerun gives the same ones."""
    parts = list_parts(workdir)
    lines_of, keeps, totals = first_copies(parts, should_stop)
    totals = per_input_row(totals)  # one line per input line, whatever its n: rows, rows_ok, rows_error count lines
    # the last part that holds a kept row of each line: the line is written once that part is read
    last_part = np.full(max((int(lines.max()) + 1 for lines in lines_of if len(lines)), default=0), -1)
    for number, (lines, keep) in enumerate(zip(lines_of, keeps)):
        last_part[lines[keep]] = number
    meta = metadata(totals)

    created = int(time.time())
    token_names = TokenNames(token_text)
    tmp = workdir / "final.jsonl.tmp"
    error_tmp = None  # no error file: failed lines go to OUTPUT
    if error_file is not None:  # beside it: a rename does not cross file systems
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_tmp = error_file.with_name(error_file.name + ".tmp")
    with writing(output, tmp):
        out = _text_file(tmp)
    with writing(error_file, error_tmp):
        errors = _text_file(error_tmp) if error_tmp is not None else None
    with out, (errors if errors is not None else nullcontext()):
        pending: dict[int, list[dict]] = {}
        for number, (part, keep) in enumerate(zip(parts, keeps)):
            if should_stop():
                raise KeyboardInterrupt
            names = pq.read_schema(part).names
            table = pq.read_table(part, columns=[c for c in OUTPUT_COLUMNS if c in names]).filter(pa.array(keep))
            for row in table.to_pylist():
                pending.setdefault(row[ROW_KEY], []).append(row)
            for line_index in [i for i in pending if last_part[i] == number]:
                key = hashlib.blake2b(f"{salt}\x00{line_index}".encode(), digest_size=12).hexdigest()
                line, failed = output_line(pending.pop(line_index), served_model, created, key, token_names)
                to_errors = failed and errors is not None
                text = json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
                try:
                    (errors if to_errors else out).write(text)
                except OSError as e:
                    raise write_error(error_file if to_errors else output, e) from e
        assert not pending, "a line's last part was passed without writing it"
        for f, path in ((out, output), (errors, error_file)):
            if f is not None:
                with writing(path):
                    f.flush()
                    os.fsync(f.fileno())
    if error_file is not None:
        with writing(error_file, error_tmp):
            os.replace(error_tmp, error_file)
            fsync_dir(error_file.parent)
    stat = tmp.stat()
    sidecar = {"batchgen": meta, "output": {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}}
    write_atomically(sidecar_path(output), lambda f: f.write(json.dumps(sidecar, indent=1).encode()))
    with writing(output, tmp):
        os.replace(tmp, output)
        fsync_dir(output.parent)
    return totals
