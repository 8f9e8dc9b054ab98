"""An LLM that is closed or dropped frees its memory: the KV pool, the model's weights, the CUDA graphs.
Dropping the last reference must free it by reference counting alone (no cycle waits for the garbage
collector), so the tests run with the collector off and watch weak references to the tensors."""
import contextlib
import gc
import weakref

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.layers.one_row_mlp import linked_one_row_mlps

ROWS = [{"id": i, "prompt": p} for i, p in enumerate(["the quick brown fox", "the quick brown dog", "hello world"])]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@contextlib.contextmanager
def no_garbage_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def build(model_dir, **options) -> LLM:
    """A small engine that has run a job: its prefix cache holds prompts, its pool has been used."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, kv_cache_tokens=256, **options)
    assert len(llm.generate_list(ROWS, GREEDY)) == len(ROWS)
    return llm


def device_memory(llm: LLM) -> list[weakref.ref]:
    """Weak references to what an engine holds on its device: the KV pool, its token table, the model
    and one of its weights."""
    runner = llm.engine.runner
    weight = next(runner.model.parameters())
    return [weakref.ref(t) for t in (runner.kv.k, runner.kv.v, runner.kv.req_to_token, runner.model, weight)]


def alive(refs: list[weakref.ref]) -> list:
    return [r() for r in refs if r() is not None]


def test_a_dropped_llm_is_freed_by_reference_counting(tiny_model):
    with no_garbage_collector():
        llm = build(tiny_model("llama"))
        refs = device_memory(llm)
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None
        assert not alive(refs)


def test_a_dropped_tensor_parallel_llm_ends_its_workers(tiny_model):
    """The engine's finalizer ends the worker processes (gloo on CPU) and holds nothing of rank 0's."""
    with no_garbage_collector():
        llm = build(tiny_model("llama"), tensor_parallel_size=2)
        refs = device_memory(llm)
        procs = llm.engine.workers.procs
        del llm
        assert not alive(refs)
        assert [p.exitcode for p in procs] == [0]  # stopped by the parent


def test_three_engines_built_and_dropped_in_one_process_do_not_accumulate(tiny_model):
    model_dir = tiny_model("llama")
    earlier: list[weakref.ref] = []
    with no_garbage_collector():
        for _ in range(3):
            llm = build(model_dir)
            assert not alive(earlier)  # the engines before this one are gone
            earlier += device_memory(llm)
            llm = None
        assert not alive(earlier)


def test_close_frees_the_memory_of_an_llm_still_referenced(tiny_model):
    with no_garbage_collector():
        with build(tiny_model("llama")) as llm:
            refs = device_memory(llm)
            assert alive(refs)
        assert not alive(refs)  # llm itself is still here
        llm.close()  # idempotent
    assert llm.describe()["kv_cache_tokens"] == 256
    with pytest.raises(RuntimeError, match="this LLM was closed .* create a new LLM"):
        llm.generate(ROWS, GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate_list(ROWS, GREEDY)


def test_closing_an_llm_while_it_generates_stops_the_generation(tiny_model):
    llm = build(tiny_model("llama"))
    results = llm.generate(ROWS * 4, SamplingParams(temperature=0, max_tokens=16))
    next(results)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(results)


def test_the_one_row_mlps_ring_holds_no_reference_cycle():
    """Each layer's one-row MLP (GPU decodes of one sequence) links to the next in a ring; the ring must
    not keep the copies of the weights alive once the model's layers are gone."""

    class Proj:
        def __init__(self, rows, cols):
            self.weight, self.bias = torch.randn(rows, cols), None

    class MLP:
        def __init__(self):
            self.gate_up_proj, self.down_proj = Proj(32, 8), Proj(8, 16)

    with no_garbage_collector():
        mlps = linked_one_row_mlps([MLP() for _ in range(3)])
        assert mlps[0].next is mlps[1] and mlps[2].next is mlps[0] and mlps[2].first is mlps[0]
        refs = [weakref.ref(m.w_down_t) for m in mlps] + [weakref.ref(m) for m in mlps]
        del mlps
        assert not alive(refs)
