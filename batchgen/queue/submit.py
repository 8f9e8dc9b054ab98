"""`batchgen submit`: an input file's rows onto the request stream, with the same readers and row
checks as `batchgen run`.

Good rows become request messages; rows that fail the checks get their error result on the job's
result stream at once (they never reach a worker). Rows go in batches, each one transaction with the
job's `submitted` counter, so a submit that was interrupted (or a rerun of a finished one) continues
where it stopped and adds no row twice.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import redis

from batchgen.io.layout import Layout
from batchgen.io.openai_input import make_checker, resolve_input_format
from batchgen.io.rows import RESERVED, ROW_KEY
from batchgen.io.sources import InputError, open_source
from batchgen.queue.protocol import Keys, encode_request, encode_result, ensure_group, text, to_json

SUBMITTER = "submit"  # the `worker` field of the error results that submit writes itself


class SubmitError(Exception):
    """The job cannot be submitted; the message says why."""


@dataclass
class SubmitResult:
    job: str
    rows: int  # rows in the job
    queued: int = 0  # requests this call added
    errors: int = 0  # rows that failed the checks; their error results were added by this call
    earlier: int = 0  # rows an earlier submit of this job had added


def fingerprint_of(path: Path) -> str:
    stat = path.stat()
    return to_json({"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})


def submit_job(client: redis.Redis, keys: Keys, job: str, path: Path, batch_rows: int = 500,
               input_format: str = "auto", served_models: list[str] | None = None) -> SubmitResult:
    """`input_format` as `run`'s; `served_models`: the body.model names an OpenAI line may give (None:
    any, as the workers' model is not known here)."""
    source = open_source(path)
    try:
        input_format = resolve_input_format(path, input_format)
    except ValueError as e:
        raise InputError(str(e)) from None
    layout = Layout(source.schema)
    clash = [n for n in layout.carried if n in RESERVED]
    if clash:
        raise SubmitError(f"input column {', '.join(clash)} has the name of an output column; rename it")
    if source.schema is not None:
        awkward = [f"{f.name} ({f.type})" for f in source.schema if f.name in layout.carried and not _json_type(f.type)]
        if awkward:
            raise SubmitError(f"column {', '.join(awkward)} cannot travel through Redis as JSON; "
                              f"cast it to a string or drop it")
    rows = source.count_rows()
    ensure_group(client, keys)
    submitted = _open_job(client, keys, job, path, source.schema, rows)
    result = SubmitResult(job, rows, earlier=submitted)
    if submitted >= rows:
        return result

    checker = make_checker(input_format, served_models)
    batch: list[tuple[str, dict | list]] = []
    start = position = submitted
    for position, row in enumerate(source):
        request, error = checker.check(row)  # every row, so that "id already seen" means what it means in `run`
        if position < submitted:
            continue
        if error is not None:
            error.pop(ROW_KEY, None)
            batch.append(("result", encode_result("", position, SUBMITTER, error)))
            result.errors += 1
        else:
            request.pop(ROW_KEY, None)
            batch.append(("request", encode_request(job, position, request)))
            result.queued += 1
        if len(batch) >= batch_rows:
            _add(client, keys, job, batch, start, position + 1)
            batch, start = [], position + 1
    if batch:
        _add(client, keys, job, batch, start, position + 1)
    return result


def _open_job(client: redis.Redis, keys: Keys, job: str, path: Path, schema: pa.Schema | None, rows: int) -> int:
    """Creates the job's hash, or checks that the existing one is this input -> rows already added."""
    fingerprint = fingerprint_of(path)
    fields = {"rows": rows, "submitted": 0, "fingerprint": fingerprint, "input": str(path),
              "created": f"{time.time():.3f}"}
    if schema is not None:
        fields["schema"] = base64.b64encode(schema.serialize().to_pybytes()).decode()

    def create_or_check(pipe: redis.client.Pipeline) -> int:
        existing = pipe.hgetall(keys.job(job))
        if existing:
            old = text(existing.get(b"fingerprint"))
            if old != fingerprint:
                raise SubmitError(f"job {job!r} already exists with another input ({text(existing.get(b'input'))}); "
                                  f"submit under another --job name")
            return int(existing.get(b"submitted") or 0)
        pipe.multi()
        pipe.hset(keys.job(job), mapping=fields)
        return 0

    return client.transaction(create_or_check, keys.job(job), value_from_callable=True)


def _add(client: redis.Redis, keys: Keys, job: str, batch: list, start: int, end: int) -> None:
    """Adds rows start..end-1 and moves the job's counter to `end`, in one transaction that fails if
    another submit moved the counter meanwhile."""
    with client.pipeline() as pipe:
        try:
            pipe.watch(keys.job(job))
            if int(pipe.hget(keys.job(job), "submitted") or 0) != start:
                raise redis.WatchError
            pipe.multi()
            for kind, fields in batch:
                if kind == "request":
                    pipe.xadd(keys.requests, fields)
                else:
                    pipe.xadd(keys.results(job), dict(zip(fields[::2], fields[1::2])))
            pipe.hset(keys.job(job), "submitted", end)
            pipe.execute()
        except redis.WatchError:
            raise SubmitError(f"another submit of job {job!r} is adding rows at the same time") from None


def _json_type(t: pa.DataType) -> bool:
    """True for the Arrow types whose values come back unchanged from JSON."""
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t):
        return True
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _json_type(t.value_type)
    if pa.types.is_struct(t):
        return all(_json_type(t.field(i).type) for i in range(t.num_fields))
    return False
