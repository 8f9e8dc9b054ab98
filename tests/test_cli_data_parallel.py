"""`batchgen run --data-parallel-size 2` on CPU (two replica processes sharing the cores): one input read
once into one output, the rows of one replica's run; SIGTERM, SIGKILL of the parent or of a replica,
and --shard keep run's guarantees (every row exactly once, the same texts); bad values are usage errors.
The parent runs in a subprocess where it or a replica is killed or signalled, else in this process
(conftest's `batchgen`: its imports paid once; the replicas are spawned processes either way)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.child_processes import alive, children_of, still_alive_after
from tests.test_cli_run import (
    JOB_OPTIONS,
    JOB_ROWS,
    REPO,
    command,
    environment,
    read,
    texts,
    wait_for_parts,
    write_jsonl,
)

pytestmark = pytest.mark.slow
DP = ["--data-parallel-size", "2"]
BAD_ROW = {"id": "bad", "prompt": 7}


@pytest.fixture(scope="module")
def job(run_job, tmp_path_factory):
    """The shared job with a bad row added, and one engine's output of its good rows (conftest's run_job)."""
    _, whole = run_job
    return write_jsonl(tmp_path_factory.mktemp("dp-job") / "job.jsonl", [*JOB_ROWS, BAD_ROW]), whole


def assert_every_row_once_with_one_engines_texts(rows: list[dict], whole: list[dict]) -> None:
    """The good rows exactly once with the texts of one engine's run, and the bad row once as an error row."""
    assert sorted(r["id"] for r in rows) == sorted([*(r["id"] for r in whole), BAD_ROW["id"]])
    assert texts([r for r in rows if r["id"] != BAD_ROW["id"]]) == texts(whole)


def test_two_replicas_write_one_output_with_one_engines_rows(job, batchgen, tmp_path):
    src, whole = job
    out = tmp_path / "out.parquet"
    done = batchgen("run", src, out, *JOB_OPTIONS, *DP)
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert_every_row_once_with_one_engines_texts(rows, whole)
    assert {r["id"]: r["error"] for r in rows}["bad"] == "prompt must be a string, got int"
    assert meta["data_parallel_size"] == 2
    assert [r["replica"] for r in meta["replicas"]] == [0, 1]
    assert sum(r["rows"] for r in meta["replicas"]) == len(rows) - 1  # (the bad row never reached a replica)
    assert "replica 0: " in done.stdout and "replica 1: " in done.stdout


def test_killed_parent_then_sigterm_then_a_rerun_give_every_row_once(job, batchgen, tmp_path):
    """SIGKILL of the parent takes its replicas along; a rerun stopped by SIGTERM exits 75; the next
    rerun completes the job with every row exactly once and one engine's texts."""
    src, whole = job
    out = tmp_path / "out.parquet"
    process = subprocess.Popen(command("run", src, out, *JOB_OPTIONS, *DP), env=environment(), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_parts(process, tmp_path / "out.parquet.partial")
    replicas = children_of(process.pid)
    assert len(replicas) >= 2
    process.kill()
    process.wait(timeout=30)
    assert not still_alive_after(replicas), "a replica outlived its killed parent"
    saved = len(list((tmp_path / "out.parquet.partial").glob("part-*.parquet")))
    process = subprocess.Popen(command("run", src, out, *JOB_OPTIONS, *DP), env=environment(), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list((tmp_path / "out.parquet.partial").glob("part-*.parquet"))) <= saved:
        if process.poll() is not None:
            pytest.fail(f"the rerun exited {process.returncode} before saving a row: "
                        f"{process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "the rerun saved no row"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr
    done = batchgen("run", src, out, *JOB_OPTIONS, *DP)
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert meta["rows_resumed"] > 0
    assert_every_row_once_with_one_engines_texts(rows, whole)


def test_a_killed_replica_loses_no_row(job, tmp_path):
    src, whole = job
    out = tmp_path / "out.parquet"
    process = subprocess.Popen(command("run", src, out, *JOB_OPTIONS, *DP), env=environment(), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_parts(process, tmp_path / "out.parquet.partial")
    replicas = sorted(children_of(process.pid))
    os.kill(replicas[-1], signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    rows, meta = read(out)
    assert_every_row_once_with_one_engines_texts(rows, whole)
    assert sum(r["failed"] for r in meta["replicas"]) == 1 and "failed during the run" in stdout


def test_a_shard_combines_with_replicas(job, batchgen, tmp_path):
    src, whole = job
    out = tmp_path / "shard-1.parquet"
    done = batchgen("run", src, out, *JOB_OPTIONS, *DP, "--shard", "1/2")
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert meta["shard"] == "1/2" and len(rows) == len(whole[1::2])
    ids = {r["id"] for r in rows}
    assert texts(rows) == {k: v for k, v in texts(whole).items() if k in ids}


@pytest.mark.parametrize("value", ["0", "x", "-1"])
def test_a_bad_data_parallel_size_is_a_usage_error(tmp_path, value, batchgen):
    src = write_jsonl(tmp_path / "in.jsonl", JOB_ROWS[:1])
    done = batchgen("run", src, tmp_path / "out.parquet", "--data-parallel-size", value)
    assert done.returncode == 2, done.stderr
    assert "invalid --data-parallel-size" in done.stderr and "give a number >= 1 or auto" in done.stderr


def test_a_worker_with_two_replicas_serves_the_queue(tmp_path_factory, tmp_path, batchgen, worker_job):
    """`batchgen worker -dp 2`: the queue's results equal `batchgen run`'s, each exactly once, and SIGTERM
    stops the worker and its replicas cleanly."""
    from tests.redis_server import start_server
    from tests.test_worker import WorkerProcess, submit_and_collect
    from tests.test_worker import texts as queue_texts

    src, reference = worker_job
    server = start_server(tmp_path_factory)
    try:
        worker = WorkerProcess(tmp_path, server.url(), "dp", "dp", *DP)
        try:
            worker.wait_event("serving")
            table = submit_and_collect(batchgen, server.url(), "dp", src, tmp_path / "out.parquet")
            assert queue_texts(table) == queue_texts(reference)
            assert json.loads(table.schema.metadata[b"batchgen"])["rows"] == len(reference)
            replicas = children_of(worker.process.pid)
            assert worker.stop() == 0, worker.log_path.read_text()[-3000:]
            assert not any(alive(p) for p in replicas)
        finally:
            worker.kill()
    finally:
        server.stop()
