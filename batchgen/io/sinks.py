"""The Parquet sink: results become small self-contained part files as they finish, and the finished
job's parts are streamed into one Parquet file that is renamed into place.

A Parquet file is readable only once its footer is written, so a job killed while writing one big
file would lose everything. Instead finished results are buffered and every `flush_rows` rows or
`flush_seconds` seconds written as `part-NNNNNN.parquet` in the work directory (temp name, fsync,
rename), so a crash loses at most the last few seconds of results and `resume` knows exactly which
rows are done.

Column types. For a Parquet input the carried-through columns keep the input schema's types and the
`id` column keeps its type (integer ids as int64). For JSONL they are inferred from the values: a
column whose values are all booleans, all integers, all numbers or all strings gets that type; any
other column (lists, objects, or values of mixed types) is stored as JSON text. `id` is int64 when
every id is an integer, else string. Each part records the kind it inferred in its field metadata,
and merging widens kinds across parts the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.io.rows import OUTPUT_FIELDS, RESERVED, ROW_KEY, ROW_SAMPLES_KEY
from batchgen.sampling_params import MAX_N
from batchgen.schema import KNOWN_FIELDS, LOGPROB_OPTIONS

OUTPUT_TYPES: dict[str, pa.DataType] = {
    "sample_index": pa.int64(),
    "text": pa.string(),
    "output_token_ids": pa.list_(pa.int32()),
    "finish_reason": pa.string(),
    "error": pa.string(),
    "prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(),
    "cached_prompt_tokens": pa.int64(),
    "num_preemptions": pa.int64(),
    "queue_s": pa.float64(),
    "ttft_s": pa.float64(),
    "prefill_s": pa.float64(),
    "decode_s": pa.float64(),
    "e2e_s": pa.float64(),
    "decode_tokens_per_s": pa.float64(),
}
assert tuple(OUTPUT_TYPES) == OUTPUT_FIELDS
# Output columns a job has only when its rows may ask for them (an input column of that name), last.
# top_logprobs: per generated token, its k most likely alternatives.
TOP_LOGPROB_TYPE = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
OPTIONAL_OUTPUT_TYPES: dict[str, pa.DataType] = {
    **{n: pa.list_(pa.float64()) for n in LOGPROB_OPTIONS},
    "top_logprobs": pa.list_(pa.list_(TOP_LOGPROB_TYPE)),
}

KIND_KEY = b"batchgen_kind"
KIND_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string(), "json": pa.string()}
FINAL_ROW_GROUP_ROWS = 65_536
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# --- column layout ------------------------------------------------------------------------------


def _value_kind(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if INT64_MIN <= value <= INT64_MAX else "json"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


def _widen(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b
    if b is None:
        return a
    if {a, b} == {"int", "float"}:
        return "float"
    return "json"


def _widen_id(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b
    return a if b is None else "str"


def _encode(values: list, kind: str) -> list:
    if kind == "json":
        return [None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in values]
    if kind == "float":
        return [None if v is None else float(v) for v in values]
    return values


def _kind_field(name: str, kind: str) -> pa.Field:
    return pa.field(name, KIND_TYPES[kind], metadata={KIND_KEY: kind.encode()})


def _field_kind(f: pa.Field) -> str | None:
    return (f.metadata or {}).get(KIND_KEY, b"").decode() or None


class Layout:
    """How result dicts become Arrow tables: `input_schema` given (Parquet input) means fixed types;
    None (JSONL input) means types inferred per part and widened at merge."""

    def __init__(self, input_schema: pa.Schema | None) -> None:
        self.input_schema = input_schema
        self.fixed_schema: pa.Schema | None = None
        self.carried: list[str] = []  # for a Parquet input: its columns that go through to the output
        if input_schema is not None:
            id_type = pa.int64()
            if "id" in input_schema.names:
                t = input_schema.field("id").type
                if pa.types.is_string(t) or pa.types.is_large_string(t):
                    id_type = t
            # (a column named like an output column is not carried: its rows are error rows that say so)
            carried = [f for f in input_schema if f.name not in KNOWN_FIELDS and f.name not in RESERVED]
            self.carried = [f.name for f in carried]
            optional = [pa.field(n, t) for n, t in OPTIONAL_OUTPUT_TYPES.items() if n in input_schema.names]
            self.fixed_schema = pa.schema(
                [pa.field("id", id_type), *carried, *(pa.field(n, t) for n, t in OUTPUT_TYPES.items()), *optional]
            )

    def part_table(self, rows: list[dict]) -> pa.Table:
        if self.fixed_schema is not None:
            return self._fixed_table(rows)
        return self._inferred_table(rows)

    def _fixed_table(self, rows: list[dict]) -> pa.Table:
        schema = self.fixed_schema.append(pa.field(ROW_KEY, pa.int64())).append(pa.field(ROW_SAMPLES_KEY, pa.int64()))
        id_is_text = not pa.types.is_integer(schema.field("id").type)
        if not id_is_text and any(isinstance(r.get("id"), str) for r in rows):
            rows = [_fallback_id_in_error(r) if isinstance(r.get("id"), str) else r for r in rows]
        columns = {}
        for f in schema:
            values = [r.get(f.name) for r in rows]
            if f.name == "id" and id_is_text:
                values = [None if v is None else str(v) for v in values]
            columns[f.name] = pa.array(values, type=f.type)
        return pa.Table.from_pydict(columns, schema=schema)

    def _inferred_table(self, rows: list[dict]) -> pa.Table:
        names: dict[str, None] = {}  # carried-through names, in order of first appearance
        for r in rows:
            for k in r:
                if k != "id" and k not in OUTPUT_TYPES and k not in RESERVED and k not in KNOWN_FIELDS:
                    names.setdefault(k)
        fields, arrays = [], []
        id_values = [r.get("id") for r in rows]
        id_kind = "int" if all(isinstance(v, int) and not isinstance(v, bool) for v in id_values) else "str"
        if id_kind == "str":
            id_values = [None if v is None else str(v) for v in id_values]
        fields.append(_kind_field("id", id_kind))
        arrays.append(pa.array(id_values, type=KIND_TYPES[id_kind]))
        for name in names:
            values = [r.get(name) for r in rows]
            kind = None
            for v in values:
                kind = _widen(kind, _value_kind(v))
            kind = kind or "str"  # all null
            fields.append(_kind_field(name, kind))
            arrays.append(pa.array(_encode(values, kind), type=KIND_TYPES[kind]))
        for name, t in OUTPUT_TYPES.items():
            fields.append(pa.field(name, t))
            arrays.append(pa.array([r.get(name) for r in rows], type=t))
        for name, t in OPTIONAL_OUTPUT_TYPES.items():
            if any(r.get(name) is not None for r in rows):
                fields.append(pa.field(name, t))
                arrays.append(pa.array([r.get(name) for r in rows], type=t))
        fields.append(pa.field(ROW_KEY, pa.int64()))
        arrays.append(pa.array([r[ROW_KEY] for r in rows], type=pa.int64()))
        fields.append(pa.field(ROW_SAMPLES_KEY, pa.int64()))
        arrays.append(pa.array([r.get(ROW_SAMPLES_KEY) for r in rows], type=pa.int64()))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def final_schema(self, part_schemas: list[pa.Schema]) -> pa.Schema:
        """The output file's schema: id, carried-through columns, output columns; no ROW_KEY."""
        if self.fixed_schema is not None:
            return self.fixed_schema
        order: dict[str, None] = {}
        kinds: dict[str, str | None] = {}
        for schema in part_schemas:
            for f in schema:
                if f.name in OUTPUT_TYPES or f.name in OPTIONAL_OUTPUT_TYPES or f.name in RESERVED:
                    continue
                order.setdefault(f.name)
                widen = _widen_id if f.name == "id" else _widen
                kinds[f.name] = widen(kinds.get(f.name), _field_kind(f))
        fields = [_kind_field("id", kinds.get("id") or "int")]
        fields += [_kind_field(n, kinds[n] or "str") for n in order if n != "id"]
        fields += [pa.field(n, t) for n, t in OUTPUT_TYPES.items()]
        asked = {f.name for schema in part_schemas for f in schema}
        fields += [pa.field(n, t) for n, t in OPTIONAL_OUTPUT_TYPES.items() if n in asked]
        return pa.schema(fields)


def _fallback_id_in_error(row: dict) -> dict:
    """An error row whose id is a fallback (io.rows: "#row:N") in an integer id column: a null id,
    the fallback named in its error instead."""
    return {**row, "id": None, "error": f"{row.get('error')} ({row['id']})"}


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` (one part) with exactly the columns and types of `schema` (which carries kinds)."""
    arrays = []
    for f in schema:
        if f.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(f.name)
        have, want = _field_kind(table.schema.field(f.name)), _field_kind(f)
        if column.type == f.type and have == want:
            arrays.append(column)
        elif want == "json":
            arrays.append(pa.array(_encode(column.to_pylist(), "json"), type=f.type))
        else:  # int -> float, or an integer id -> string id
            arrays.append(pc.cast(column, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` without our per-field bookkeeping metadata."""
    return pa.schema([f.remove_metadata() for f in schema], metadata=schema.metadata)


# --- part files ---------------------------------------------------------------------------------


def part_number(path: Path) -> int:
    return int(path.name[len("part-") : -len(".parquet")])


def list_parts(workdir: Path) -> list[Path]:
    parts = [p for p in workdir.glob("part-*.parquet") if p.name[5:-8].isdigit()]
    return sorted(parts, key=part_number)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputWriteError(Exception):
    """A file of the job's output could not be written (a full disk, no permission); the message
    names the file."""


@contextmanager
def writing(path: Path, tmp: Path | None = None):
    """Turns an OSError in the block into an OutputWriteError that names `path`, and removes `tmp`
    (a file half written, which would hold the space a full disk needs)."""
    try:
        yield
    except OSError as e:
        raise write_error(path, e, tmp) from e


def write_error(path: Path, error: OSError, tmp: Path | None = None) -> OutputWriteError:
    if tmp is not None:
        tmp.unlink(missing_ok=True)
    return OutputWriteError(f"cannot write {path}: {error.strerror or ' '.join(str(error).split())}")


def write_atomically(path: Path, write) -> None:
    """Calls write(file) on `path`.tmp, fsyncs it, renames it to `path` and fsyncs the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)


class PartWriter:
    """Buffers finished results and writes them out as part files.

    `add` may be called from the engine's request-pulling code as well as from the result loop, so
    the buffer is guarded by a lock.
    """

    def __init__(self, workdir: Path, layout: Layout, flush_rows: int = 1000, flush_seconds: float = 5.0) -> None:
        self.workdir = workdir
        self.layout = layout
        self.flush_rows = max(1, flush_rows)
        self.flush_seconds = flush_seconds
        existing = list_parts(workdir)
        self._next_part = part_number(existing[-1]) + 1 if existing else 1
        self._buffer: list[dict] = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, row: dict) -> None:
        with self._lock:
            self._buffer.append(row)
            if len(self._buffer) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        table = self.layout.part_table(self._buffer)
        path = self.workdir / f"part-{self._next_part:06d}.parquet"
        write_atomically(path, lambda f: pq.write_table(table, f))
        self._next_part += 1
        self.rows_written += len(self._buffer)
        self._buffer.clear()


# --- the final file -----------------------------------------------------------------------------


TOTALS_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "e2e_s", "ttft_s")


@dataclass
class Totals:
    """Job totals over every row of the final file (this run's and resumed ones)."""

    rows: int = 0
    rows_ok: int = 0
    rows_error: int = 0
    requests: int = 0  # input rows answered (a row with n samples has n output rows)
    requests_error: int = 0  # of them, rows with an error row
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, reused from the prefix cache
    output_tokens: int = 0
    e2e_s: list = field(default_factory=list)  # numpy chunks, ok rows only
    ttft_s: list = field(default_factory=list)

    def add(self, table: pa.Table) -> None:
        errors = pc.equal(table.column("finish_reason"), "error").fill_null(False)
        n_error = pc.sum(errors).as_py() or 0
        self.rows += table.num_rows
        self.rows_error += n_error
        self.rows_ok += table.num_rows - n_error
        self.prompt_tokens += pc.sum(table.column("prompt_tokens")).as_py() or 0
        self.cached_prompt_tokens += pc.sum(table.column("cached_prompt_tokens")).as_py() or 0
        self.output_tokens += pc.sum(table.column("completion_tokens")).as_py() or 0
        ok = table.filter(pc.invert(errors))
        for name, chunks in (("e2e_s", self.e2e_s), ("ttft_s", self.ttft_s)):
            values = ok.column(name).drop_null().to_numpy()
            if len(values):
                chunks.append(values)

    def percentiles(self, name: str) -> dict[str, float | None]:
        chunks = getattr(self, name)
        if not chunks:
            return {"p50": None, "p95": None}
        values = np.concatenate(chunks)
        p50, p95 = np.percentile(values, [50, 95])
        return {"p50": float(p50), "p95": float(p95)}


def prefix_cache_totals(totals: Totals) -> dict:
    """The job metadata's prefix cache figures: prompt tokens reused, and their share of all."""
    rate = totals.cached_prompt_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0
    return {"cached_prompt_tokens": totals.cached_prompt_tokens, "prefix_cache_hit_rate": round(rate, 4)}


def _read_keys(part: Path, extra: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray, pa.Table]:
    """A part's (input row index, sample_index) per output row, and the table read (with `extra`)."""
    names = pq.read_schema(part).names
    table = pq.read_table(part, columns=[ROW_KEY, *extra] + (["sample_index"] if "sample_index" in names else []))
    indices = table.column(ROW_KEY).to_numpy()
    samples = (table.column("sample_index").fill_null(0).to_numpy().clip(0, MAX_N - 1) if "sample_index" in names
               else np.zeros(len(indices), dtype=np.int64))
    return indices, samples, table


def read_row_keys(part: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A part's (input row index, sample_index, is an error row, the row's number of samples) per
    output row (samples: 1 where the part does not say, as in parts of older versions)."""
    stored = ("finish_reason", ROW_SAMPLES_KEY) if ROW_SAMPLES_KEY in pq.read_schema(part).names else ("finish_reason",)
    indices, samples, table = _read_keys(part, stored)
    errors = pc.equal(table.column("finish_reason"), "error").fill_null(False).to_numpy(zero_copy_only=False)
    counts = (table.column(ROW_SAMPLES_KEY).fill_null(1).to_numpy() if ROW_SAMPLES_KEY in table.column_names
              else np.ones(len(indices), dtype=np.int64))
    return indices, samples, errors, counts


def first_copies(parts: list[Path], should_stop=lambda: False) -> tuple[list[np.ndarray], list[np.ndarray], Totals]:
    """Which rows of `parts` go to the final file: the first copy of each (input row, sample_index),
    in part order. -> per part, its rows' input row indices and their keep mask; and the totals over
    the rows kept.

    First the parts' keys decide which rows to keep, then one pass reads only the columns that the
    totals need, so that a writer can put `metadata(totals)` before the rows."""
    totals = Totals()
    rows, keys = [], []
    for part in parts:
        if should_stop():
            raise KeyboardInterrupt
        indices, samples, _ = _read_keys(part)
        rows.append(indices)
        keys.append(indices.astype(np.int64) * MAX_N + samples)  # one int64 per (row, sample)
    every = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    first = np.zeros(len(every), dtype=bool)
    first[np.unique(every, return_index=True)[1]] = True
    totals.requests = len(np.unique(every[first] // MAX_N))
    keeps = np.split(first, np.cumsum([len(k) for k in keys])[:-1]) if parts else []
    failed = []  # per part, the input rows of its kept error rows
    for part, keep, indices in zip(parts, keeps, rows):
        if should_stop():
            raise KeyboardInterrupt
        table = pq.read_table(part, columns=[c for c in TOTALS_COLUMNS if c in pq.read_schema(part).names])
        for name in TOTALS_COLUMNS:  # (cached_prompt_tokens: absent from the parts of older versions)
            if name not in table.column_names:
                table = table.append_column(name, pa.nulls(table.num_rows, pa.int64()))
        totals.add(table if keep.all() else table.filter(pa.array(keep)))
        errors = pc.equal(table.column("finish_reason"), "error").fill_null(False).to_numpy(zero_copy_only=False)
        failed.append(indices[keep & errors])
    totals.requests_error = len(np.unique(np.concatenate(failed))) if failed else 0
    return rows, keeps, totals


def per_input_row(totals: Totals) -> Totals:
    """`totals` with rows counted as input rows (an output that has one line per input row, whatever
    its n): rows_error are the rows with an error, rows_ok the rest."""
    return dataclasses.replace(totals, rows=totals.requests, rows_error=totals.requests_error,
                               rows_ok=totals.requests - totals.requests_error)


def merge_parts(workdir: Path, output: Path, layout: Layout, metadata, should_stop=lambda: False) -> Totals:
    """Streams every part into `output`, each (input row, sample_index) at most once (first_copies),
    then renames it into place. `metadata(totals)` (the `batchgen` key) goes into the schema before
    the last pass copies the rows in row groups of up to FINAL_ROW_GROUP_ROWS rows."""
    parts = list_parts(workdir)
    schema = layout.final_schema([pq.read_schema(p) for p in parts])
    _, keeps, totals = first_copies(parts, should_stop)
    keep_masks = [None if keep.all() else keep for keep in keeps]

    final = plain_schema(schema).with_metadata({"batchgen": json.dumps(metadata(totals))})
    tmp = workdir / "final.parquet.tmp"
    with writing(output, tmp):
        writer = pq.ParquetWriter(tmp, final)
    try:
        pending: list[pa.Table] = []
        pending_rows = 0
        for part, keep in zip(parts, keep_masks):
            if should_stop():
                raise KeyboardInterrupt
            table = pq.read_table(part)
            if keep is not None:
                table = table.filter(pa.array(keep))
            pending.append(conform(table, schema).cast(final))
            pending_rows += pending[-1].num_rows
            if pending_rows >= FINAL_ROW_GROUP_ROWS or part == parts[-1]:
                with writing(output, tmp):  # (only the writes: an error reading a part is not about OUTPUT)
                    writer.write_table(pa.concat_tables(pending))
                pending, pending_rows = [], 0
    finally:
        with writing(output, tmp):
            writer.close()
    with writing(output, tmp):
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, output)
        fsync_dir(output.parent)
    return totals
