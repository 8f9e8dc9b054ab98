"""The prefix cache in the engine: greedy outputs are the same with it on and off, whatever the rows
share (nothing, one token, part of a chunk, a whole prompt, a prompt that is another's prefix),
under pools and budgets small enough to evict and preempt; the reused tokens are counted exactly."""
import random

import pytest

from batchgen import LLM, SamplingParams
from tests.tiny_models import VOCAB


def shared_prefix_rows():
    rng = random.Random(5)
    base = [rng.randrange(VOCAB - 1) for _ in range(40)]

    def tail(n):
        return [rng.randrange(VOCAB - 1) for _ in range(n)]

    prompts = [
        tail(12),  # shares nothing
        base[:1] + tail(9),  # one token
        base[:5] + tail(7),  # part of a chunk
        base,  # a whole prompt...
        list(base),  # ...twice
        base[:20],  # a prefix of another prompt
        base + tail(6),  # the whole of another prompt, and more
        base[:20] + tail(3),
        base[:33] + tail(11),
    ]
    return [{"id": i, "prompt_token_ids": p} for i, p in enumerate(prompts)]


def generate(model_dir, rows, enable_prefix_caching, **options):
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=enable_prefix_caching, **options)
    results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=16))
    kv, cache = llm.engine.kv, llm.engine.scheduler.cache
    assert kv.num_available == kv.num_slots  # every slot free or held only by the cache
    if cache is not None:
        cache.clear()
        assert kv.num_free == kv.num_slots
    return results


SETTINGS = {
    "roomy": dict(max_num_seqs=16),
    "small": dict(kv_cache_tokens=80, max_num_seqs=4, max_num_batched_tokens=8),
}
SETTINGS["small_fp8"] = {**SETTINGS["small"], "kv_cache_dtype": "fp8"}  # cached prefixes in an fp8 pool


@pytest.mark.parametrize("kind,setting", [("llama", "roomy"), ("llama", "small"), ("qwen2", "small"),
                                          ("qwen3", "small"), ("llama", "small_fp8"), ("qwen3", "small_fp8")])
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(kind, setting, tiny_model):
    rows = shared_prefix_rows()
    on = generate(tiny_model(kind), rows, True, **SETTINGS[setting])
    off = generate(tiny_model(kind), rows, False, **SETTINGS[setting])
    assert [r["output_token_ids"] for r in on] == [r["output_token_ids"] for r in off]
    assert all(r["error"] is None for r in on)
    assert all(r["cached_prompt_tokens"] == 0 for r in off)
    assert all(0 <= r["cached_prompt_tokens"] < r["prompt_tokens"] for r in on)
    assert sum(r["cached_prompt_tokens"] for r in on) >= 39 + 20  # the repeated prompt, the 20-token prefix
    if setting.startswith("small"):
        assert sum(r["num_preemptions"] for r in on) > 0


def test_a_planned_job_computes_a_shared_prefix_once(tiny_model):
    rng = random.Random(2)
    system = [rng.randrange(VOCAB - 1) for _ in range(100)]
    rows = [{"id": i, "prompt_token_ids": system + [rng.randrange(VOCAB - 1) for _ in range(1 + i % 7)]}
            for i in range(50)]
    llm = LLM(str(tiny_model("llama")), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=2))
    assert sorted(r["cached_prompt_tokens"] for r in results) == [0] + [100] * 49


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), dtype="float32", max_num_seqs=8)


def test_n_samples_share_the_prompt_and_are_reproducible(llm):
    prompt = list(range(1, 30))
    sampling = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    rows = [{"id": "a", "prompt_token_ids": prompt, "n": 4, "seed": 7}, {"id": "b", "prompt_token_ids": [5, 6, 7]}]
    first = llm.generate_list(rows, sampling)
    assert [(r["id"], r["sample_index"]) for r in first] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)]
    samples = [tuple(r["output_token_ids"]) for r in first[:4]]
    assert len(set(samples)) == 4  # each sample has its own seed
    assert sorted(r["cached_prompt_tokens"] for r in first[:4]) == [0, 28, 28, 28]  # the prompt computed once
    llm.engine.scheduler.cache.clear()
    again = llm.generate_list(list(reversed(rows)), sampling)  # another batch, another order: the same samples
    assert [tuple(r["output_token_ids"]) for r in again if r["id"] == "a"] == samples
    alone = llm.generate_list([{"id": "a", "prompt_token_ids": prompt, "seed": 7}], sampling)  # n=1: sample 0
    assert alone[0]["sample_index"] == 0 and tuple(alone[0]["output_token_ids"]) == samples[0]
    by_default = llm.generate_list([{"id": "c", "prompt_token_ids": prompt}], sampling.replace(n=3))
    assert [r["sample_index"] for r in by_default] == [0, 1, 2]


@pytest.mark.parametrize("n,message", [(0, "n must be in [1, 1024], got 0"), (2.5, "n must be an integer"),
                                       ("two", "n must be an integer")])
def test_a_bad_n_is_one_error_row(llm, n, message):
    results = llm.generate_list([{"id": "x", "prompt_token_ids": [1, 2], "n": n}], SamplingParams(max_tokens=2))
    assert len(results) == 1 and results[0]["finish_reason"] == "error" and message in results[0]["error"]
    assert results[0]["sample_index"] == 0
