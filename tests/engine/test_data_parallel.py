"""Data parallelism (batchgen/replicas/) on CPU: two replica processes give the rows of one engine, each
exactly once, whatever happens to a replica: one killed mid-job (its rows go to the other), both killed
(a clear error), a parent killed (no replica left behind), a consumer that stops reading early."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from batchgen.replicas import ReplicaError, prefix_key
from tests.child_processes import alive, still_alive_after

OPTIONS = dict(device="cpu", dtype="float32", max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def rows(count=40):
    return [{"id": f"r{i}", "prompt_token_ids": [1 + (i * 7 + j) % 200 for j in range(3 + i % 17)],
             **({"n": 2} if i % 5 == 0 else {})} for i in range(count)]


def by_key(results):
    results = list(results)
    keyed = {(r["id"], r["sample_index"]): r for r in results}
    assert len(keyed) == len(results), "a row came back twice"
    return keyed


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def single(model_dir):
    llm = LLM(model_dir, **OPTIONS)
    try:
        return by_key(llm.generate_list(rows(), GREEDY))
    finally:
        llm.close()


@pytest.fixture
def pool(model_dir):
    llm = LLM(model_dir, data_parallel_size=2, **OPTIONS)
    yield llm
    llm.close()


def tokens(keyed):
    return {k: r["output_token_ids"] for k, r in keyed.items()}


def test_two_replicas_give_one_engines_rows(pool, single):
    bad = {"id": "bad", "prompt": 5}
    results = list(pool.generate([*rows(), bad], GREEDY))
    keyed = by_key(results)
    assert keyed.pop(("bad", 0))["error"] == "prompt must be a string, got int"
    assert tokens(keyed) == tokens(single)
    assert pool.describe()["data_parallel_size"] == 2
    replicas = pool.stats["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and all(r["rows"] > 0 for r in replicas)
    assert sum(r["rows"] for r in replicas) == len(results)
    assert pool.stats["output_tokens"] == sum(len(r["output_token_ids"]) for r in results)
    # the pool serves a second job, and a live source's None ("nothing right now")
    live = [None, *rows(6)[:3], None, None, *rows(6)[3:]]
    assert tokens(by_key(pool.generate(live, GREEDY))) == {k: v for k, v in tokens(single).items()
                                                           if k[0] in {f"r{i}" for i in range(6)}}


def test_a_replica_killed_mid_job_loses_no_row(pool, single):
    slow = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(pool.config.model, **OPTIONS).generate_list(rows(), slow)
    results = []
    for result in pool.generate(rows(), slow):
        if len(results) == 3:
            os.kill(pool.engine.children.pids[1], signal.SIGKILL)
        results.append(result)
    assert tokens(by_key(results)) == tokens(by_key(want))
    assert pool.stats["replicas"][1]["failed"]
    # the replica left serves the next job alone
    assert tokens(by_key(pool.generate(rows(), GREEDY))) == tokens(single)


def test_every_replica_killed_is_one_clear_error(pool):
    slow = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    results = []
    with pytest.raises(ReplicaError, match=r"data-parallel replica [01] failed: its process was killed by SIGKILL"):
        for result in pool.generate(rows(), slow):
            if not results:
                for pid in pool.engine.children.pids:
                    os.kill(pid, signal.SIGKILL)
            results.append(result)


def test_a_consumer_that_stops_early_leaves_the_pool_ready(pool, single):
    for _ in pool.generate(rows(), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)):
        break
    assert tokens(by_key(pool.generate(rows(), GREEDY))) == tokens(single)


def test_prefix_keys_group_shared_starts():
    system = {"role": "system", "content": "You are terse. " * 30}
    a = {"messages": [system, {"role": "user", "content": "hi"}]}
    b = {"messages": [system, {"role": "user", "content": "bye"}]}
    assert prefix_key(a) == prefix_key(b) != prefix_key({"messages": [{"role": "user", "content": "hi"}]})
    assert prefix_key({"prompt": "x" * 300 + "a"}) == prefix_key({"prompt": "x" * 300 + "b"})
    assert prefix_key({"prompt": 5}) is None and prefix_key("not a row") is None


PARENT = """
import json, sys
from batchgen import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", data_parallel_size=2)
    print(json.dumps(llm.engine.children.pids), flush=True)
    while True:
        llm.generate_list([{"prompt_token_ids": [1, 2, 3]}] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
"""


def test_killed_parent_leaves_no_replicas(model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen([sys.executable, str(script), model_dir], stdout=subprocess.PIPE, env=env)
    try:
        pids = json.loads(parent.stdout.readline())
        time.sleep(1.0)  # mid-generation
        assert all(alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    assert not still_alive_after(pids), f"orphaned replicas: {pids}"
