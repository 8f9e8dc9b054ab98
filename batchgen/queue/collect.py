"""`batchgen collect`: a job's result stream into the same Parquet file as `batchgen run` writes.

Reads the result stream from its start (XREAD, no consumer group: collecting never changes what
workers see, and can be repeated), keeps the first result of each row (of each sample of a row of n
samples), and when every row of the job has them, writes the file through the Parquet sink (part
files in a temporary directory beside OUTPUT, merged and renamed into place). A row can be answered
twice (by a worker that wrote its result just before a restart lost the acknowledgement); the second
answer is counted and dropped.
"""

from __future__ import annotations

import base64
import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import redis

from batchgen.io.layout import Layout
from batchgen.io.openai_output import write_openai_output
from batchgen.io.parts import PartWriter
from batchgen.io.resume import JobError
from batchgen.io.rows import ROW_KEY
from batchgen.io.sinks import Totals, merge_parts, prefix_cache_totals
from batchgen.queue.protocol import Backoff, Keys, is_retryable, text
from batchgen.sampling_params import MAX_N
from batchgen.version import __version__

log = logging.getLogger("batchgen.collect")


class CollectTimeout(Exception):
    def __init__(self, job: str, rows: int, missing: np.ndarray, waited: float) -> None:
        self.rows, self.missing = rows, len(missing)
        sample = ", ".join(str(i) for i in missing[:10]) + (", ..." if len(missing) > 10 else "")
        super().__init__(f"timed out after {waited:.0f}s: {len(missing)} of {rows} rows of job {job!r} have no result "
                         f"yet (row positions {sample}); rerun collect to wait longer")


@dataclass
class CollectResult:
    rows: int  # rows of the job
    extra: int = 0  # results of messages that no submitted row made (a malformed message of another producer)
    duplicates: int = 0  # second answers, dropped
    unreadable: int = 0  # result entries that are not JSON, skipped
    totals: Totals | None = None
    metadata: dict = field(default_factory=dict)


def collect_job(client: redis.Redis, keys: Keys, job: str, output: Path, timeout_s: float | None = None,
                should_stop: Callable[[], bool] = lambda: False, delete: bool = False,
                output_format: str = "parquet", error_file: Path | None = None,
                token_text: Callable[[int], str] | None = None) -> CollectResult:
    """`output_format` "openai" writes the OpenAI batch output file (failed lines to `error_file` if
    given). `token_text` spells a token of OpenAI logprobs; without it a token is named by the text
    the engine gave for it, else as `token_id:ID`."""
    started = time.monotonic()
    deadline = None if timeout_s is None else started + timeout_s
    backoff = Backoff()

    def call(fn, *args, **kwargs):
        """fn(...), retried while Redis is unreachable, until the deadline."""
        while True:
            try:
                value = fn(*args, **kwargs)
                backoff.succeeded()
                return value
            except redis.RedisError as e:
                if not is_retryable(e):
                    raise
                delay = backoff.failed()
                if backoff.failures == 1:
                    log.warning("redis: %s: %s; retrying", type(e).__name__, e)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                if should_stop():
                    raise KeyboardInterrupt from None

    info = {text(k): text(v) for k, v in call(client.hgetall, keys.job(job)).items()}
    if not info:
        raise JobError(f"no job {job!r} under prefix {keys.prefix!r}: submit it first (or check --prefix)")
    rows, schema = _job_rows(info, keys.job(job)), _job_schema(info, keys.job(job))
    layout = Layout(schema)
    result = CollectResult(rows)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.collect-", dir=output.parent) as tmp:
        writer = _CheckedWriter(PartWriter(Path(tmp), layout, flush_rows=1000, flush_seconds=float("inf")),
                                keys.results(job))
        try:
            done = np.zeros(rows, dtype=bool)
        except MemoryError:
            raise JobError(f"field rows of {keys.job(job)} is {rows}: more rows than this machine can track; "
                           f"the job's hash was not written by batchgen submit (resubmit under a new --job name)"
                           ) from None
        partial: dict[int, set] = {}  # rows of several samples with some of their results: sample indices seen
        have = 0
        extra_keys: set[str] = set()
        last_id = "0-0"
        while have < rows:
            if should_stop():
                raise KeyboardInterrupt
            block_ms = 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectTimeout(job, rows, np.flatnonzero(~done), time.monotonic() - started)
                block_ms = max(1, min(block_ms, int(left * 1000)))
            try:
                reply = call(client.xread, {keys.results(job): last_id}, count=1000, block=block_ms)
            except redis.RedisError as e:
                if not is_retryable(e):
                    raise
                continue  # unreachable until the deadline: the loop reports the timeout
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = text(entry_id)
                    fields = {text(k): text(v) for k, v in fields.items()}
                    try:
                        row = json.loads(fields["result"])
                        assert isinstance(row, dict)
                    except (KeyError, ValueError, AssertionError, RecursionError):
                        result.unreadable += 1
                        log.warning("result %s of job %s is not a JSON object; skipped", last_id, job)
                        continue
                    index = fields.get("index")
                    if index is not None and index.isdecimal() and int(index) < rows:
                        index = int(index)
                        if done[index]:
                            result.duplicates += 1
                            continue
                        samples = int(fields["samples"]) if (fields.get("samples") or "").isdecimal() else 1
                        sample = row.get("sample_index")
                        if isinstance(sample, bool) or not isinstance(sample, int) or not 0 <= sample < MAX_N:
                            sample = row["sample_index"] = 0  # (another producer's result)
                        got = partial.setdefault(index, set())
                        if sample in got:
                            result.duplicates += 1
                            continue
                        got.add(sample)
                        if len(got) >= samples:  # the row is done once every sample's result is here
                            del partial[index]
                            done[index] = True
                            have += 1
                        row[ROW_KEY] = index
                    else:
                        key = fields.get("request") or last_id
                        if key in extra_keys:
                            result.duplicates += 1
                            continue
                        extra_keys.add(key)
                        row[ROW_KEY] = rows + len(extra_keys) - 1
                        result.extra += 1
                    if row.get("output_token_ids") is None:
                        row["output_token_ids"] = []
                    writer.add(last_id, row)
        writer.flush()

        workers = {text(k): _json_object(text(v)) for k, v in call(client.hgetall, keys.workers(job)).items()}
        last_s = int(last_id.split("-")[0]) / 1000
        job_seconds = max(0.0, last_s - _number(info.get("created"), last_s))

        def metadata(totals: Totals) -> dict:
            meta = _common(list(workers.values()))
            meta.update(
                job=job, prefix=keys.prefix, input=info.get("input"), batchgen_version=__version__,
                workers=sorted(workers), rows=totals.rows, rows_ok=totals.rows_ok, rows_error=totals.rows_error,
                rows_extra=result.extra, duplicates_dropped=result.duplicates, prompt_tokens=totals.prompt_tokens,
                output_tokens=totals.output_tokens, **prefix_cache_totals(totals), job_seconds=round(job_seconds, 3),
                output_tokens_per_s=round(totals.output_tokens / job_seconds, 2) if job_seconds > 0 else None,
                wall_seconds=round(time.monotonic() - started, 3),
                e2e_s=totals.percentiles("e2e_s"), ttft_s=totals.percentiles("ttft_s"),
            )
            result.metadata = meta
            return meta

        if output_format == "openai":
            served = _common(list(workers.values())).get("model") or "batchgen"
            result.totals = write_openai_output(Path(tmp), output, metadata, served_model=str(served),
                                                salt=f"{keys.prefix}\x00{job}\x00{info.get('created')}",
                                                token_text=token_text, error_file=error_file,
                                                should_stop=should_stop)
        else:
            result.totals = merge_parts(Path(tmp), output, layout, metadata, should_stop=should_stop)
    if delete:
        call(client.delete, keys.job(job), keys.results(job), keys.workers(job))
    return result


def _common(descriptions: list[dict]) -> dict:
    """The settings every worker of the job had in common (model, dtype, sampling defaults, ...)."""
    if not descriptions:
        return {}
    first, rest = descriptions[0], descriptions[1:]
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in rest)}


def _json_object(value: str) -> dict:
    try:
        data = json.loads(value)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class _CheckedWriter:
    """The part writer, fed only rows it can write: a result entry whose fields have the wrong types
    (another producer's, or a worker of another version) becomes an error row naming the entry and
    the field, instead of failing the whole file when its part is written."""

    def __init__(self, writer: PartWriter, stream: str) -> None:
        self.writer, self.stream = writer, stream
        self._pending: list[tuple[str, dict]] = []  # (entry id, row)

    def add(self, entry: str, row: dict) -> None:
        """`row`, from the result entry of id `entry`."""
        self._pending.append((entry, row))
        if len(self._pending) >= self.writer.flush_rows:
            self.flush()

    def flush(self) -> None:
        rows = [row for _, row in self._pending]
        try:
            self.writer.layout.part_table(rows)  # the same conversion as the writer's: all fine, the usual case
        except _CONVERSION_ERRORS:
            rows = [self._writable(entry, row) for entry, row in self._pending]
        for row in rows:
            self.writer.add(row)
        self.writer.flush()
        self._pending.clear()

    def _writable(self, entry: str, row: dict) -> dict:
        layout = self.writer.layout
        try:
            layout.part_table([row])
            return row
        except _CONVERSION_ERRORS as e:
            problem = _one_line(e)
        for key, value in row.items():  # name the first field that cannot be written alone
            try:
                layout.part_table([{ROW_KEY: row[ROW_KEY], key: value}])
            except _CONVERSION_ERRORS as e:
                problem = f"field {key!r}: {_one_line(e)}"
                break
        log.warning("result entry %s of %s is malformed (%s); its row becomes an error row", entry, self.stream,
                    problem)
        error = {ROW_KEY: row[ROW_KEY], "output_token_ids": [], "finish_reason": "error",
                 "error": f"result entry {entry} of {self.stream} could not be written: {problem}"}
        for key in ("id", "sample_index"):  # kept where they can be
            try:
                layout.part_table([{ROW_KEY: row[ROW_KEY], key: row.get(key)}])
                error[key] = row.get(key)
            except _CONVERSION_ERRORS:
                pass
        return error


# What pyarrow raises for a value of the wrong type or range (ArrowTypeError is a TypeError,
# ArrowInvalid a ValueError).
_CONVERSION_ERRORS = (TypeError, ValueError, OverflowError, pa.ArrowException)


def _job_rows(info: dict, key: str) -> int:
    value = info.get("rows")
    if value is None or not value.isdecimal():
        raise JobError(f"field rows of {key} is {value!r}, not a row count: the job's hash was not written by "
                       f"batchgen submit (resubmit under a new --job name)")
    return int(value)


def _job_schema(info: dict, key: str) -> pa.Schema | None:
    """The input's Arrow schema (a Parquet input), as submit stored it."""
    if not info.get("schema"):
        return None
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(info["schema"], validate=True)))
    except (ValueError, pa.ArrowException) as e:  # binascii.Error is a ValueError
        raise JobError(f"field schema of {key} is not an Arrow schema ({type(e).__name__}: {e}): the job's hash "
                       f"was not written by batchgen submit (resubmit under a new --job name)") from None


def _one_line(error: Exception, limit: int = 200) -> str:
    message = " ".join(str(error).split())
    return message if len(message) <= limit else message[:limit] + "..."


def _number(value: str | None, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default
