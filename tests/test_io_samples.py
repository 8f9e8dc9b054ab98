"""A file job with n samples per row: one output row per (id, sample_index), exactly once across
interruptions and resumes, a row done only when all its samples are."""
from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow.parquet as pq

from batchgen.io import JobSpec, run_job
from batchgen.io.resume import DoneRows
from batchgen.schema import SAMPLES_KEY
from tests.test_io_job import StandInLLM, prompts, read_rows, write_jsonl


class SamplingStandIn(StandInLLM):
    """The stand-in engine, answering each request with its n samples (those of SAMPLES_KEY when
    given), samples of a request far apart in the output."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.samples_run: list = []

    def generate(self, requests, sampling=None, stop_event=None):
        def expanded():
            for request in requests:
                n = request.get("n", 1)
                for i in request.get(SAMPLES_KEY) or range(n):
                    yield {**{k: v for k, v in request.items() if k != SAMPLES_KEY}, "sample_index": i}

        for result in super().generate(expanded(), sampling, stop_event):
            self.samples_run.append((result["id"], result["sample_index"]))
            yield result


def run(tmp_path, src, llm):
    spec = JobSpec(input=src, output=tmp_path / "out.parquet", settings={"model": "stand-in"}, flush_rows=1)
    return run_job(spec, lambda: llm, sampling=None, stop_event=threading.Event())


def test_samples_are_written_once_across_a_resume(tmp_path):
    rows = [dict(r, n=1 + i % 4) for i, r in enumerate(prompts(9))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    first = SamplingStandIn(in_flight=5, stop_after=7)
    assert run(tmp_path, src, first).status == "interrupted"
    second = SamplingStandIn(in_flight=5)
    result = run(tmp_path, src, second)
    assert result.status == "complete"
    expected = {(r["id"], i) for r in rows for i in range(r["n"])}
    assert not set(first.samples_run) & set(second.samples_run)  # nothing generated twice
    assert set(first.samples_run) | set(second.samples_run) == expected
    out = read_rows(tmp_path / "out.parquet")
    assert sorted((r["id"], r["sample_index"]) for r in out) == sorted(expected)
    meta = json.loads(pq.read_schema(tmp_path / "out.parquet").metadata[b"batchgen"])
    assert meta["rows"] == len(expected) and meta["rows_ok"] == len(expected)


def test_done_rows_knows_partial_rows_and_error_rows():
    indices = np.array([0, 1, 1, 3, 4])
    samples = np.array([0, 0, 2, 0, 0])
    errors = np.array([False, False, False, False, True])
    done = DoneRows(indices, samples, errors)
    assert done.missing(0, 1) == [] and done.missing(0, 3) == [1, 2]
    assert done.missing(1, 3) == [1] and done.missing(2, 2) == [0, 1]
    assert done.missing(3, 1) == [] and done.missing(4, 5) == []  # an error row answers the whole row
    assert done.missing(99, 2) == [0, 1] and done.num_rows == 4
