"""What a file job tells: the rows a stopped run counts are the rows its rerun skips; an OpenAI output
counts its lines; progress lines count tokens as they are generated; a corrupt input or a full disk
is one line naming the file; an input column named like an output column gives error rows, from
Parquet as from JSONL. A tiny model, in process unless a real process is the point."""

from __future__ import annotations

import io
import json
import re
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchgen import LLM, SamplingParams
from batchgen.io import JobSpec, run_job
from batchgen.progress import LogLines
from tests.stopping_llm import StopAfterFirstResult

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_stopped_run_counts_the_rows_its_rerun_skips(tiny_model, tmp_path):
    """n = 2 samples a row, one sequence at a time: the stop comes after a row's first sample, so that
    row is not done (the rerun generates its second sample), and neither count may say it is."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"the quick fox {i}"} for i in range(3)])
    llm = LLM(tiny_model("llama"), dtype="float32", max_num_seqs=1)
    spec = JobSpec(input=src, output=tmp_path / "out.parquet", settings={"model": "tiny", "n": 2}, flush_rows=1)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, n=2)
    stop = threading.Event()
    first = run_job(spec, lambda: StopAfterFirstResult(llm, stop), sampling, stop)
    assert first.status == "interrupted"
    assert (first.rows_resumed, first.rows_this_run) == (0, 0)  # one sample of r0 saved: no row done

    second = run_job(spec, lambda: llm, sampling, threading.Event())
    assert second.status == "complete"
    assert second.rows_resumed == first.rows_resumed + first.rows_this_run  # the summary's "in all"
    assert second.rows_resumed + second.rows_this_run == second.rows_total == 3
    assert second.metadata["rows_resumed"] == second.rows_resumed
    out = pq.read_table(spec.output).to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in out) == [(f"r{i}", s) for i in range(3) for s in range(2)]


def openai_lines(count: int) -> list[dict]:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 2}} for i in range(count)]
    lines[0]["body"]["n"] = 3
    return lines


def test_an_openai_file_of_12_lines_reports_12_rows(batchgen, tiny_model, tmp_path):
    """One line asks for 3 samples: 14 samples, but 12 lines in and 12 lines out."""
    src = write_jsonl(tmp_path / "batch.jsonl", openai_lines(12))
    options = ["--model", tiny_model("llama"), "--served-model-name", "tiny", "--log-every", "0"]
    done = batchgen("run", src, tmp_path / "results.jsonl", *options)
    assert done.returncode == 0, done.stderr
    assert "starting: 12 rows" in done.stdout and "done: 12 rows (12 ok, 0 errors)" in done.stdout, done.stdout
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 12
    sidecar = json.loads((tmp_path / "results.jsonl.batchgen.json").read_text())["batchgen"]
    assert (sidecar["rows"], sidecar["rows_ok"], sidecar["rows_error"]) == (12, 12, 0)

    parquet = batchgen("run", src, tmp_path / "results.parquet", *options)  # a row per sample there
    assert parquet.returncode == 0, parquet.stderr
    assert "done: 14 rows of 12 input rows (14 ok, 0 errors)" in parquet.stdout, parquet.stdout


class ReportWhenTheFirstRowEnds(LogLines):
    """Progress lines (no timer): one is printed when the first row finishes, the other still running."""

    def advance(self, row: dict) -> None:
        super().advance(row)
        if self.counts.rows == 1:
            self.report()


def test_progress_lines_count_the_tokens_of_rows_still_running(tiny_model, tmp_path):
    """Two rows start together; when the 20-token one ends, the 60-token one has 20 tokens too."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "short", "prompt": "the quick fox", "max_tokens": 20},
                                              {"id": "long", "prompt": "the lazy dog", "max_tokens": 60}])
    llm = LLM(tiny_model("llama"), dtype="float32", max_num_seqs=4)
    text = io.StringIO()
    progress = ReportWhenTheFirstRowEnds(Console(file=text, width=200), interval=0)
    spec = JobSpec(input=src, output=tmp_path / "out.parquet", settings={"model": "tiny"})
    result = run_job(spec, lambda: llm, SamplingParams(ignore_eos=True), threading.Event(), progress)
    assert result.status == "complete"
    line = next(line for line in text.getvalue().splitlines() if "progress:" in line)
    found = re.search(r"progress: 1/2 rows \(0 errors\), ([\d,]+) tokens, ([\d,]+) tok/s", line)
    assert found, line
    assert int(found[1].replace(",", "")) >= 2 * 20 and int(found[2].replace(",", "")) > 0


def corrupt_parquet(path: Path) -> Path:
    """A Parquet file whose footer is fine and whose second row group's data is garbage."""
    table = pa.table({"id": list(range(8)), "prompt": [f"the quick fox number {i} " * 8 for i in range(8)]})
    pq.write_table(table, path, row_group_size=4, compression="snappy")
    meta = pq.read_metadata(path)
    column = meta.row_group(1).column(1)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + 20 : start + column.total_compressed_size - 4] = b"\x5a" * (column.total_compressed_size - 24)
    path.write_bytes(bytes(data))
    return path


def test_a_corrupt_parquet_input_is_one_line_naming_the_file(batchgen, tiny_model, tmp_path):
    src = corrupt_parquet(tmp_path / "prompts.parquet")
    done = batchgen("run", src, tmp_path / "out.parquet", "--model", tiny_model("llama"), "--max-tokens", "2",
                    "--log-every", "0")
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"batchgen: error: input file {str(src)!r} cannot be read (is it corrupt?)" in done.stderr, done.stderr


def test_a_full_disk_is_one_line_naming_the_file(tiny_model, tmp_path):
    """A file size limit (RLIMIT_FSIZE: writes past it fail, EFBIG) that job.json fits under and a part
    file does not: the same failed write as a full disk, in a real process."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"the quick fox {i}"} for i in range(3)])
    out = tmp_path / "out.parquet"

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    done = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", src, out, "--model", tiny_model("llama"),
                           "--max-tokens", "2", "--log-every", "0"], cwd=REPO, capture_output=True, text=True,
                          preexec_fn=limit_file_size, timeout=300)
    assert done.returncode == 1, done.stderr
    error, = [line for line in done.stderr.splitlines() if "error" in line.lower()]  # (the rest: INFO logs)
    assert error.startswith(f"batchgen: error: cannot write {out}.partial/part-000001.parquet: File too large")
    assert error.endswith("rerun the same command to resume")
    assert not list((tmp_path / "out.parquet.partial").glob("*.tmp"))  # the half-written part is removed


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_an_input_column_named_like_an_output_column_makes_error_rows(batchgen, tiny_model, tmp_path, kind):
    """README (Input): such a column makes its row an error row saying so; the job goes on, exit 0."""
    rows = [{"id": f"r{i}", "prompt": f"the quick fox {i}", "text": f"mine {i}", "topic": i} for i in range(3)]
    src = tmp_path / f"in.{kind}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), src)
    else:
        write_jsonl(src, rows)
    out = tmp_path / "out.parquet"
    done = batchgen("run", src, out, "--model", tiny_model("llama"), "--max-tokens", "2", "--log-every", "0")
    assert done.returncode == 0, done.stderr
    assert "done: 3 rows (0 ok, 3 errors)" in done.stdout
    got = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert set(got) == {"r0", "r1", "r2"}
    for i in range(3):
        row = got[f"r{i}"]
        assert row["finish_reason"] == "error" and row["text"] is None and row["topic"] == i
        assert row["error"] == "column text is reserved for the output; rename it"
