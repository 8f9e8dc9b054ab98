"""`batchgen worker` end to end: real worker processes, the real engine on the embedded default model,
a real redis-server. submit and collect run in this process (their imports are paid once).

Kept small for CI's 2 CPU cores: 8 rows of exactly 8 greedy tokens, two at a time, in fp32 (greedy
texts are compared with `batchgen run`'s, and fp32 does not round near-ties differently in different
batches). Every worker here loads the model once (~10 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.queue import Keys
from batchgen.queue.protocol import GROUP, ensure_group
from tests.redis_server import PASSWORD, USER, start_server

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

ROWS = [{"id": f"row{i}", "prompt": f"Write a short note number {i} about the weather in spring.", "num": i}
        for i in range(8)]
OPTIONS = ["--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--max-num-seqs", "2", "--dtype", "float32"]


def environment() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_") or k == "BATCHGEN_CACHE"}
    return {**env, "PYTHONUNBUFFERED": "1"}


class WorkerProcess:
    """`batchgen worker` in a subprocess, its JSON log in a file."""

    def __init__(self, tmp: Path, url: str, prefix: str, name: str, *extra: str) -> None:
        self.name = name
        self.log_path = tmp / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "batchgen.cli", "worker", "--redis-url", url, "--prefix", prefix,
                 "--consumer", name, "--log-format", "json", *OPTIONS, *extra],
                stdout=subprocess.DEVNULL, stderr=log, env=environment(), cwd=REPO,
            )

    def events(self, name: str | None = None) -> list[dict]:
        entries = []
        for line in self.log_path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
        return [e for e in entries if name is None or e.get("event") == name]

    def wait_event(self, name: str, timeout: float = 180) -> dict:
        return wait_for(lambda: (self.events(name) or [None])[0], timeout, f"{self.name}: {name}", self)

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def wait_for(condition, timeout: float, what: str, worker: WorkerProcess | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if worker is not None and worker.process.poll() is not None:
            log = worker.log_path.read_text()[-3000:]
            raise AssertionError(f"{worker.name} exited {worker.process.returncode}:\n{log}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory)
    yield server
    server.stop()


def texts(table) -> dict:
    return {r["id"]: (r["text"], r["output_token_ids"], r["num"]) for r in table.to_pylist()}


def submit_and_collect(batchgen, url, prefix, src, output, before_collect=lambda: None):
    code, out, err = batchgen("submit", src, "--redis-url", url, "--prefix", prefix, "--job", "j")
    assert code == 0, err
    before_collect()
    code, out, err = batchgen("collect", output, "--redis-url", url, "--prefix", prefix, "--job", "j",
                              "--timeout", "300")
    assert code == 0, err
    return pq.read_table(output)


@pytest.fixture(scope="module")
def worker(server, tmp_path_factory):
    """One worker for the first tests: a user:password URL, metrics on a free port, claim idle 1 s."""
    tmp = tmp_path_factory.mktemp("worker")
    w = WorkerProcess(tmp, server.url(USER, PASSWORD), "shared", "w", "--metrics-port", "0",
                      "--claim-idle-seconds", "1")
    yield w
    code = w.stop()
    w.kill()
    assert code == 0, w.log_path.read_text()[-3000:]


def test_submit_worker_collect_gives_the_same_results_as_run(worker, server, worker_job, batchgen, tmp_path):
    src, reference = worker_job
    worker.wait_event("serving")
    table = submit_and_collect(batchgen, server.url(USER, PASSWORD), "shared", src, tmp_path / "out.parquet")
    assert texts(table) == texts(reference)
    assert table.column_names == reference.column_names
    assert table.schema.field("num").type == reference.schema.field("num").type
    meta, run_meta = (json.loads(t.schema.metadata[b"batchgen"]) for t in (table, reference))
    assert meta["workers"] == ["w"] and meta["rows"] == 8 and meta["rows_ok"] == 8
    assert meta["model"] == run_meta["model"] and meta["dtype"] == run_meta["dtype"] == "float32"
    assert meta["settings"]["temperature"] == 0 and meta["duplicates_dropped"] == 0
    # the worker resolves its sampling defaults as run does: options, then the model's generation_config.json
    assert meta["sampling_defaults"] == run_meta["sampling_defaults"] and meta["generation_config"] == "auto"
    assert meta["sampling_defaults_from"]["temperature"] == "option"
    assert meta["sampling_defaults_from"]["top_p"] == "generation_config"
    assert server.client().xlen(Keys("shared").results("j")) == 8  # one result each, none answered twice
    port = worker.wait_event("metrics")["port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "batchgen:generation_tokens_total 64.0" in body
    assert 'batchgen:request_success_total{finished_reason="length"} 8.0' in body
    for name in ("batchgen:num_requests_running", "batchgen:num_requests_waiting", "batchgen:kv_cache_usage_perc",
                 "batchgen:time_to_first_token_seconds_bucket", "batchgen:e2e_request_latency_seconds_bucket"):
        assert name in body, name


def test_malformed_message_and_poison_request_with_the_real_worker(worker, server):
    client, keys = server.client(), Keys("shared")
    worker.wait_event("serving")
    ensure_group(client, keys)
    # a request that three workers took and died on (crashed by it, as far as anyone can tell): added and
    # taken by the first in one transaction, so that the live worker does not get it first
    with client.pipeline() as pipe:
        pipe.xadd(keys.requests, {"job": "bad", "index": "1", "request": json.dumps({"id": "p", "prompt": "x"})})
        pipe.xreadgroup(GROUP, "ghost1", {keys.requests: ">"}, count=1)
        poison, taken = pipe.execute()
    assert taken[0][1][0][0] == poison
    for ghost in ("ghost2", "ghost3"):
        client.xclaim(keys.requests, GROUP, ghost, 0, [poison])
    good = json.dumps({"id": "good", "prompt": "Say hello."})
    client.xadd(keys.requests, {"request": good})  # no job: dead letter
    client.xadd(keys.requests, {"job": "bad", "index": "0", "request": "{oops"})  # malformed: error result
    client.xadd(keys.requests, {"job": "bad", "index": "2", "request": good})
    results = wait_for(lambda: (lambda r: r if len(r) == 3 else None)(client.xrange(keys.results("bad"))), 120,
                       "3 results", worker)
    rows = {int(f[b"index"]): json.loads(f[b"result"]) for _, f in results}
    assert "not JSON" in rows[0]["error"] and rows[0]["finish_reason"] == "error"
    assert "delivered 4 times" in rows[1]["error"] and rows[1]["id"] == "p"
    assert rows[2]["finish_reason"] == "length" and rows[2]["text"]  # the worker lived on
    dead = [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.dead)]
    reasons = sorted(d["reason"].split(":")[0] for d in dead)
    assert reasons == ["delivered 4 times without a result (--max-deliveries 3)", "malformed message"]
    assert client.xpending(keys.requests, GROUP)["pending"] == 0
    assert worker.process.poll() is None


def test_a_killed_workers_rows_are_finished_by_another_each_exactly_once(server, worker_job, batchgen, tmp_path):
    src, reference = worker_job
    url, client, keys = server.url(), server.client(), Keys("kill")
    first = WorkerProcess(tmp_path, url, "kill", "a", "--claim-idle-seconds", "1")
    second = None
    try:
        def kill_mid_job():
            wait_for(lambda: client.xlen(keys.results("j")) >= 1, 180, "a first result", first)
            first.stop(signal.SIGKILL)
            nonlocal second
            left = [p for p in client.xpending_range(keys.requests, GROUP, "-", "+", 100) if p["consumer"] == b"a"]
            assert left and client.xlen(keys.results("j")) < 8  # it died holding requests
            second = WorkerProcess(tmp_path, url, "kill", "b", "--claim-idle-seconds", "1")

        table = submit_and_collect(batchgen, url, "kill", src, tmp_path / "out.parquet", kill_mid_job)
        assert texts(table) == texts(reference)
        assert client.xlen(keys.results("j")) == 8  # not one row answered twice
        assert second.events("reclaimed")
        assert sorted(json.loads(table.schema.metadata[b"batchgen"])["workers"]) == ["a", "b"]
        assert second.stop() == 0
    finally:
        for w in (first, second):
            if w is not None:
                w.kill()


def test_sigterm_finishes_in_flight_rows_then_exits_0_leaving_the_rest_to_others(server, worker_job, batchgen,
                                                                                  tmp_path):
    src, _ = worker_job
    url, client, keys = server.url(), server.client(), Keys("drain")
    # one row at a time (2 taken at once): a wide window for the signal to land mid-job
    w = WorkerProcess(tmp_path, url, "drain", "d", "--drain-timeout", "300", "--max-num-seqs", "1")
    try:
        code, _, err = batchgen("submit", src, "--redis-url", url, "--prefix", "drain", "--job", "j")
        assert code == 0, err
        wait_for(lambda: client.xlen(keys.results("j")) >= 1, 180, "a first result", w)
        assert w.stop(signal.SIGTERM) == 0
    finally:
        w.kill()
    draining, stopped = w.wait_event("draining"), w.wait_event("stopped")
    # everything the engine had when the signal came was finished
    assert draining["in_flight"] >= 1 and stopped["results"] - draining["results"] >= draining["in_flight"]
    done = client.xlen(keys.results("j"))
    assert done == stopped["results"] < 8
    # the rest is for other workers: never delivered, or handed back (claimable at once)
    handed_back = client.xautoclaim(keys.requests, GROUP, "other", min_idle_time=60_000)[1]
    assert len(handed_back) == stopped["left"]
    fresh = client.xreadgroup(GROUP, "other", {keys.requests: ">"}) or [[None, []]]
    assert done + len(handed_back) + len(fresh[0][1]) == 8


def test_redis_restarted_mid_job_loses_nothing(tmp_path_factory, worker_job, batchgen, tmp_path):
    src, reference = worker_job
    server = start_server(tmp_path_factory, "restarted")
    w = WorkerProcess(tmp_path, server.url(), "restart", "r", "--max-num-seqs", "1")  # a longer job
    client, keys = server.client(), Keys("restart")
    try:
        def restart_mid_job():
            wait_for(lambda: client.xlen(keys.results("j")) >= 1, 180, "a first result", w)
            assert client.xlen(keys.results("j")) < 8
            server.stop()
            time.sleep(3)  # the engine goes on generating; results wait in the worker
            # down until the worker has met the outage (a loaded machine may take longer than 3 s
            # to finish its next row and try to write it)
            wait_for(lambda: w.events("redis_unavailable"), 180, "the worker to notice the outage", w)
            server.start()

        table = submit_and_collect(batchgen, server.url(), "restart", src, tmp_path / "out.parquet", restart_mid_job)
        assert texts(table) == texts(reference)
        assert client.xlen(keys.results("j")) == 8
        assert w.events("redis_unavailable") and w.events("redis_available")
        assert w.stop() == 0
    finally:
        w.kill()
        server.stop()
