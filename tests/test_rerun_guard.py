"""Reruns on an OUTPUT that exists: the same job does nothing, another job's OUTPUT (other settings, or
not a batchgen output) is refused unless --overwrite, and an input edited in place (same size, mtime
put back) is a different input, for a finished OUTPUT and for a leftover alike. In process, tiny model."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen import LLM, SamplingParams
from batchgen.io import JobError, JobSpec, run_job
from batchgen.io.resume import workdir_for
from tests.stopping_llm import StopAfterFirstResult


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def edit_in_place(path: Path, old: str, new: str) -> None:
    """Replace text by text of the same length and put the mtime back: only the content differs."""
    assert len(old) == len(new)
    stat = path.stat()
    path.write_text(path.read_text().replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def metadata(path: Path) -> dict:
    return json.loads(pq.read_schema(path).metadata[b"batchgen"])


@pytest.fixture
def job(batchgen, tiny_model, tmp_path):
    """run(*options) on three prompts into out.parquet -> Done."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"the quick fox {i}"} for i in range(3)])
    out = tmp_path / "out.parquet"

    def run(*options, output: Path = out):
        return batchgen("run", src, output, "--model", tiny_model("llama"), "--dtype", "float32", "--ignore-eos",
                        "--log-every", "0", *options)

    return run, src, out


def test_a_finished_output_of_other_settings_is_refused_unless_overwrite(job):
    run, _, out = job
    assert run("--max-tokens", "4").returncode == 0
    before = out.read_bytes()
    again = run("--max-tokens", "4")
    assert again.returncode == 0 and "already complete" in again.stdout

    refused = run("--max-tokens", "5")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "max_tokens: 4 then, 5 now" in refused.stderr and "--overwrite" in refused.stderr
    assert out.read_bytes() == before and not workdir_for(out).exists()

    replaced = run("--max-tokens", "5", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert metadata(out)["fingerprint"]["max_tokens"] == 5
    assert {len(ids) for ids in pq.read_table(out).column("output_token_ids").to_pylist()} == {5}


@pytest.mark.parametrize("name", ["other.parquet", "other.jsonl"])
def test_an_output_that_batchgen_did_not_write_is_refused_unless_overwrite(job, tmp_path, name):
    run, _, _ = job
    other = tmp_path / name
    other.write_text("someone else's file\n")
    refused = run("--max-tokens", "2", output=other)
    assert refused.returncode == 1 and "is not a finished batchgen output" in refused.stderr, refused.stderr
    assert other.read_text() == "someone else's file\n"
    assert run("--max-tokens", "2", "--overwrite", output=other).returncode == 0
    assert other.read_bytes() != b"someone else's file\n"


def test_a_finished_output_of_an_input_edited_in_place_is_not_taken_for_complete(job):
    run, src, out = job
    assert run("--max-tokens", "2").returncode == 0
    edit_in_place(src, "fox 1", "cat 1")
    refused = run("--max-tokens", "2")
    assert refused.returncode == 1 and "input.blake2b" in refused.stderr, refused.stdout + refused.stderr
    assert run("--max-tokens", "2", "--overwrite").returncode == 0
    again = run("--max-tokens", "2")
    assert again.returncode == 0 and "already complete" in again.stdout


def test_a_leftover_of_an_input_edited_in_place_is_refused(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"the quick fox {i}"} for i in range(4)])
    llm = LLM(tiny_model("llama"), dtype="float32", max_num_seqs=1)
    spec = JobSpec(input=src, output=tmp_path / "out.parquet", settings={"model": "tiny"}, flush_rows=1)
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    stop = threading.Event()
    first = run_job(spec, lambda: StopAfterFirstResult(llm, stop), sampling, stop)
    assert first.status == "interrupted" and first.rows_this_run >= 1

    edit_in_place(src, "fox 3", "cat 3")
    with pytest.raises(JobError, match=r"other settings \(input\.blake2b: .*--no-resume"):
        run_job(spec, lambda: llm, sampling, threading.Event())
