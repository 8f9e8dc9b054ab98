"""The Parquet sink's final file: the finished job's part files (parts.py) are streamed into one
Parquet file that is renamed into place, each (input row, sample) once, with the job's totals in its
metadata.

A Parquet file is readable only once its footer is written, so a job killed while writing one big
file would lose everything: hence the part files, and this one file written only at the end. Column
types: layout.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.io.layout import Layout, conform, plain_schema
from batchgen.io.parts import fsync_dir, list_parts, writing
from batchgen.io.rows import ROW_KEY, ROW_SAMPLES_KEY
from batchgen.sampling_params import MAX_N

FINAL_ROW_GROUP_ROWS = 65_536
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
