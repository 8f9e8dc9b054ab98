"""torch's CPU thread count (executor/cpu_threads.py): EngineConfig.cpu_threads fixes it; auto takes the
usable cores less those that other processes keep busy, so that a shared machine is not oversubscribed."""
import multiprocessing as mp
import time

import pytest
import torch

from batchgen import LLM, EngineConfig, SamplingParams
from batchgen.executor.cpu_threads import (
    CpuSample,
    CpuThreads,
    cores_busy_elsewhere,
    parse_proc_stat,
    threads_for,
    usable_cores,
)

ROWS = [{"id": i, "prompt": "the quick brown fox " * 4} for i in range(8)]


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def busy_cores():
    """One process per usable core, each keeping it busy."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=spin, daemon=True) for _ in range(usable_cores())]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # (started: past the interpreter's start-up)
    yield
    for proc in procs:
        proc.kill()
        proc.join()


def spin():
    while True:
        pass


def test_cpu_threads_from_the_environment_and_checked(monkeypatch):
    monkeypatch.delenv("BATCHGEN_CPU_THREADS", raising=False)
    assert EngineConfig().cpu_threads is None
    monkeypatch.setenv("BATCHGEN_CPU_THREADS", "3")
    assert EngineConfig().cpu_threads == 3
    assert EngineConfig(cpu_threads=1).cpu_threads == 1  # an argument wins
    monkeypatch.setenv("BATCHGEN_CPU_THREADS", "auto")
    assert EngineConfig().cpu_threads is None
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("BATCHGEN_CPU_THREADS", bad)
        with pytest.raises(ValueError,
                           match=f"invalid BATCHGEN_CPU_THREADS: '{bad}'; give a number of threads >= 1, or auto"):
            EngineConfig()
    monkeypatch.delenv("BATCHGEN_CPU_THREADS")
    with pytest.raises(ValueError, match="invalid --cpu-threads: 0"):
        EngineConfig(cpu_threads=0)


def test_a_fixed_thread_count_is_used_and_described(tiny_model):
    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="float32", max_num_seqs=8, cpu_threads=1)
    assert llm.describe()["cpu_threads"] == 1
    llm.generate_list(ROWS, SamplingParams(temperature=0, max_tokens=4))
    assert torch.get_num_threads() == 1
    llm.close()
    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="float32", max_num_seqs=8)
    assert llm.describe()["cpu_threads"] == "auto"
    llm.close()


@pytest.mark.parametrize("cores, elsewhere, threads", [
    (2, 0.0, 2), (2, 0.45, 2), (2, 0.55, 1), (2, 1.0, 1), (2, 2.0, 1), (4, 1.0, 3), (8, 2.6, 5), (1, 1.0, 1),
])
def test_one_thread_fewer_for_each_core_others_hold(cores, elsewhere, threads):
    assert threads_for(cores, elsewhere) == threads


def test_the_load_of_other_processes_from_proc_stat():
    """Cores 0 and 1 are ours (core 2 is not); between the samples 2 s passed on each, 2.5 s of it busy,
    1.0 s of it ours: others kept 0.75 of a core busy."""

    def stat(busy0, idle0, busy1, idle1):
        return (f"cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 {busy0} 0 0 {idle0} 0 0 0 0 0 0\n"
                f"cpu1 {busy1} 0 0 {idle1} 0 0 0 0 0 0\ncpu2 999 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")

    before = CpuSample(*parse_proc_stat(stat(100, 100, 100, 100), {0, 1}), own_s=5.0)
    after = CpuSample(*parse_proc_stat(stat(250, 150, 200, 200), {0, 1}), own_s=6.0)
    assert (before.busy, before.total) == (200, 400)
    assert cores_busy_elsewhere(before, after, 2, 100) == pytest.approx(0.75)
    assert cores_busy_elsewhere(after, after, 2, 100) == 0.0


def test_auto_gives_way_to_processes_that_keep_every_core_busy(busy_cores):
    threads = CpuThreads(None)
    assert threads.automatic and torch.get_num_threads() == usable_cores()
    end = time.monotonic() + 1.6
    while time.monotonic() < end:  # (this process idles: the load is the others')
        time.sleep(0.05)
        threads.adjust()
    assert threads.threads == torch.get_num_threads() == 1


def test_the_engine_adjusts_its_threads_between_steps(tiny_model, busy_cores):
    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="float32", max_num_seqs=8)
    end = time.monotonic() + 1.6
    while time.monotonic() < end:
        llm.generate_list(ROWS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.runner.cpu_threads.threads == torch.get_num_threads() == 1
    llm.close()
