"""Tensor parallelism: TP=2 gives TP=1's tokens on the tiny models (gloo on CPU; NCCL and CUDA graphs
where two GPUs are visible), with default and squeezed settings (a tiny token budget that chunks
prefill, a tiny KV pool that preempts), with a replicated KV head, with sampling and logprobs. A
difference is tolerated only where TP=1's top-2 logits were within 1e-3 (an fp32 near-tie). A worker
that raises or is killed gives one clear error and leaves no process behind; so does a killed parent.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.executor.tp_workers import TensorParallelError, TPWorkers
from tests.child_processes import alive, still_alive_after
from tests.tiny_models import VOCAB, load_hf, save_tokenizer

DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
FAILURE_DEVICES = [DEVICE]
LENGTHS = [1, 3, 17, 40, 64, 29]
SQUEEZED = dict(max_num_seqs=6, max_num_batched_tokens=12, kv_cache_tokens=80)  # chunks and preempts
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in LENGTHS]


def generate(model_dir, tp, rows, sampling=GREEDY, device=DEVICE, **options):
    llm = LLM(str(model_dir), dtype="float32", device=device, tensor_parallel_size=tp, **options)
    try:
        if tp == 1 or device == "cpu":
            assert llm.describe()["tensor_parallel_all_reduce"] == ("none" if tp == 1 else "gloo")
        results = llm.generate_list(rows, sampling)
        assert llm.engine.kv.num_available == llm.engine.kv.num_slots  # every slot free or only cached
        return results
    finally:
        llm.close()


def assert_same_tokens(model_dir, rows, expected, results):
    hf = None
    for row, a, b in zip(rows, expected, results):
        ours, theirs = a["output_token_ids"], b["output_token_ids"]
        i = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
        if i is None:
            assert ours == theirs and a["finish_reason"] == b["finish_reason"]
            continue
        hf = hf or load_hf(model_dir)
        with torch.no_grad():
            top2 = hf(torch.tensor([row["prompt_token_ids"] + ours[:i]])).logits[0, -1].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-3, f"token {i}: TP=1 {ours} vs TP=2 {theirs}"


def assert_tp_matches(model_dir, **options):
    rows = [{"prompt_token_ids": p} for p in prompts()]
    single = generate(model_dir, 1, rows, **options)
    double = generate(model_dir, 2, rows, **options)
    assert_same_tokens(model_dir, rows, single, double)
    assert [r["num_preemptions"] for r in single] == [r["num_preemptions"] for r in double]
    return double


# (qwen2, fp8: --kv-cache-dtype fp8, each rank rounding its own heads' K/V into its fp8 pool)
@pytest.mark.parametrize("kind,options", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                          ("qwen2", {"kv_cache_dtype": "fp8"})])
def test_squeezed_settings_match_tp1(kind, options, tiny_model):
    results = assert_tp_matches(tiny_model(kind), **options, **SQUEEZED)
    assert sum(r["num_preemptions"] for r in results) > 0


def test_prefix_cache_matches_tp1(tiny_model):
    """Rows sharing prefixes of every length, squeezed: the cached prefixes' token-table writes
    reach every rank."""
    from tests.engine.test_prefix_caching import shared_prefix_rows

    model_dir, rows = tiny_model("qwen3"), shared_prefix_rows()
    single = generate(model_dir, 1, rows, **SQUEEZED)
    double = generate(model_dir, 2, rows, **SQUEEZED)
    assert_same_tokens(model_dir, rows, single, double)
    assert [r["cached_prompt_tokens"] for r in single] == [r["cached_prompt_tokens"] for r in double]
    assert sum(r["cached_prompt_tokens"] for r in double) > 0


def test_sampling_and_logprobs_match_tp1(tiny_model):
    """Default settings; seeded sampling (rank 0 samples, the others get its tokens by broadcast),
    the sampled tokens' logprobs and prompt logprobs."""
    model_dir = tiny_model("qwen2")
    rows = [{"prompt_token_ids": p, "seed": i, "logprobs": True, "prompt_logprobs": True}
            for i, p in enumerate(prompts())]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    single, double = generate(model_dir, 1, rows, sampling), generate(model_dir, 2, rows, sampling)
    assert_same_tokens(model_dir, rows, single, double)
    for a, b in zip(single, double):
        if a["output_token_ids"] == b["output_token_ids"]:
            torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(b["prompt_logprobs"]), torch.tensor(a["prompt_logprobs"]),
                                   atol=1e-4, rtol=0)


def test_constrained_rows_and_top_logprobs_match_tp1(tiny_model):
    """Constrained rows beside free ones, sampled, with a token budget that chunks prefill: rank 0
    masks and samples, the others run the forward only (preemption: tests/engine/test_structured.py)."""
    pytest.importorskip("xgrammar")
    model_dir = tiny_model("qwen2")
    rows = [{"prompt_token_ids": p, "seed": i, "top_logprobs": 3,
             **({"structured_outputs": {"regex": "[a-z]{2,3}( [0-9a-z]{2,3}){2,4}"}} if i % 2 == 0
                else {"ignore_eos": True})}
            for i, p in enumerate(p for p in prompts() if len(p) < 64)]  # (64 + max_tokens > the KV pool)
    sampling = SamplingParams(temperature=0.8, max_tokens=24)
    squeezed = {**SQUEEZED, "kv_cache_tokens": 64}
    single, double = [generate(model_dir, tp, rows, sampling, **squeezed) for tp in (1, 2)]
    assert all(r["error"] is None for r in single + double)
    assert_same_tokens(model_dir, rows, single, double)
    for a, b in zip(single, double):
        if a["output_token_ids"] == b["output_token_ids"]:
            values = [[e["logprob"] for e in top] for top in a["top_logprobs"]]
            torch.testing.assert_close(torch.tensor([[e["logprob"] for e in top] for top in b["top_logprobs"]]),
                                       torch.tensor(values), atol=1e-4, rtol=0)
    assert all(r["finish_reason"] == "stop" for r in double[::2])


def test_replicated_kv_head_matches_tp1(tmp_path):
    """One KV head, two ranks: each rank holds a copy of it."""
    import transformers as tf

    torch.manual_seed(5)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    assert_tp_matches(tmp_path, max_num_seqs=8, max_num_batched_tokens=16)


def test_unsplittable_heads_fail_cleanly(tiny_model):
    """3 ranks for 4 heads: rank 0's own error raised as it is (or, where a worker fails first and its exit
    breaks rank 0's rendezvous, that worker's report of the same error), and no worker left behind."""
    before = {p.pid for p in _children()}
    with pytest.raises((ValueError, TensorParallelError), match="attention heads .4. is not divisible"):
        LLM(str(tiny_model("llama")), dtype="float32", device="cpu", tensor_parallel_size=3)
    assert {p.pid for p in _children()} <= before


def _children():
    import multiprocessing

    return multiprocessing.active_children()


PARENT = """
import json, sys
from batchgen import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", device=sys.argv[2], tensor_parallel_size=2)
    print(json.dumps(llm.engine.workers.pids), flush=True)
    while True:
        llm.generate_list([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=50, ignore_eos=True))
"""


@pytest.mark.parametrize("device", FAILURE_DEVICES)
def test_killed_parent_leaves_no_workers(device, tiny_model, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_model("llama")), device],
                              stdout=subprocess.PIPE, env=env)
    try:
        pids = json.loads(parent.stdout.readline())
        time.sleep(0.5)  # mid-generation
        assert all(alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    assert not still_alive_after(pids), f"orphaned workers: {pids}"


def _sabotage(monkeypatch, at_step, action):
    """Call action(workers, data) instead of sending the at_step-th step's inputs."""
    real_send, calls = TPWorkers.send, []

    def send(self, inputs):
        calls.append(1)
        if len(calls) == at_step:
            return action(self, inputs)
        return real_send(self, inputs)

    monkeypatch.setattr(TPWorkers, "send", send)


def _run_until_failure(model_dir, device):
    llm = LLM(str(model_dir), dtype="float32", device=device, tensor_parallel_size=2, max_num_seqs=8,
              max_num_batched_tokens=16)
    workers = llm.engine.workers
    with pytest.raises(TensorParallelError) as failure:
        llm.generate_list([{"prompt_token_ids": p} for p in prompts()], GREEDY)
    assert all(p.exitcode is not None for p in workers.procs)  # ended and reaped
    with pytest.raises(TensorParallelError):  # the engine stays failed
        llm.engine.step()
    return str(failure.value)


@pytest.mark.parametrize("device", FAILURE_DEVICES)
def test_worker_that_raises_gives_one_clear_error(device, tiny_model, monkeypatch):
    def garbage(workers, inputs):
        for conn in workers.steps:
            conn.send_bytes(b"garbage!")

    _sabotage(monkeypatch, 3, garbage)
    message = _run_until_failure(tiny_model("llama"), device)
    assert message.startswith("tensor-parallel rank 1 failed: ValueError: a step message of 1 values"), message


@pytest.mark.parametrize("device", FAILURE_DEVICES)
def test_killed_worker_gives_one_clear_error(device, tiny_model, monkeypatch):
    real_send = TPWorkers.send

    def kill(workers, inputs):
        os.kill(workers.pids[0], signal.SIGKILL)
        wait([workers.procs[0].sentinel])
        real_send(workers, inputs)

    _sabotage(monkeypatch, 3, kill)
    message = _run_until_failure(tiny_model("llama"), device)
    assert message == "tensor-parallel rank 1 failed: its process was killed by SIGKILL", message


def test_abort_waits_a_bounded_time_and_runs_once():
    """NCCL's abort blocks until no CUDA graph holds the group: ours returns after wait_s, and a
    second call waits on the same abort instead of starting another."""
    import threading

    from batchgen.parallel.tensor_parallel import TensorParallel

    class SlowGroup:
        def __init__(self):
            self.calls, self.release = 0, threading.Event()

        def abort(self):
            self.calls += 1
            self.release.wait()

    group = SlowGroup()
    tp = TensorParallel(rank=0, size=2, group=group)
    started = time.monotonic()
    tp.abort(wait_s=0.2)
    tp.abort(wait_s=0.2)
    assert 0.3 < time.monotonic() - started < 5 and group.calls == 1
    group.release.set()  # the graphs are freed: the abort finishes
    tp.abort(wait_s=5)
    assert group.calls == 1 and not tp._aborting[0].is_alive()


@pytest.mark.parametrize("kind,quantization", [("llama", None), ("qwen3-moe", None), ("qwen2-moe", None),
                                               ("qwen3-moe", "fp8"), ("llama", "fp8")])
def test_layers_hand_partial_sums_to_the_norm_after_each_product(kind, quantization, tiny_model, monkeypatch):
    """Where the fused all-reduce + add + RMSNorm serves (two GPUs with peer access), each row-parallel
    product, and each MoE block (its experts' sum, plus Qwen2-MoE's shared expert), hands on PartialSums
    and the RMSNorm after it (the next layer's, the post-attention one, the final one) sums them. All of a
    model's sums before norms must, or none: that kernel leaves the residual right on its rank's rows only,
    which a plain norm after it would read whole. FP8 products make tensors of their own, so with
    --quantization fp8 none defers, the MoE blocks neither. Routed here on one CPU rank through the kernel's
    reference, as rank 0 of two (the other rows of each new residual NaN): the same prompt logprobs as the
    plain path (every position's final norm and LM head), and two such sums a layer (none for fp8)."""
    from batchgen.kernels.all_reduce_rmsnorm import all_reduce_add_rmsnorm_ref
    from batchgen.parallel.tensor_parallel import TensorParallel

    model_dir = tiny_model(kind)
    rows = [{"prompt_token_ids": p, "prompt_logprobs": True} for p in prompts() if len(p) > 1]
    scoring = SamplingParams(temperature=0, max_tokens=1)
    options = {"quantization": quantization} if quantization else {}
    plain = generate(model_dir, 1, rows, scoring, device="cpu", **options)
    calls, whole_residuals = [], {}

    def summed_with_norm(self, partials, residual, weight, eps):
        """As rank 0 of two sees it: the new residual right on its rows only (the rest NaN here), and the
        next such call reading its rows alone (the other rank's from the whole residual kept aside)."""
        calls.append(partials.shape)
        share = -(-residual.shape[0] // 2)
        whole = whole_residuals.pop(residual.data_ptr(), None)
        if whole is not None and whole.shape == residual.shape and residual[share:].isnan().all():
            residual = whole
        normed, residual = all_reduce_add_rmsnorm_ref([partials], residual, weight, eps)
        whole_residuals[residual.data_ptr()] = residual.clone()
        residual[share:] = float("nan")
        return normed, residual

    monkeypatch.setattr(TensorParallel, "defers_sum", lambda self, partials: True)
    monkeypatch.setattr(TensorParallel, "all_reduce_add_rmsnorm", summed_with_norm)
    routed = generate(model_dir, 1, rows, scoring, device="cpu", **options)
    for a, b in zip(plain, routed):
        torch.testing.assert_close(torch.tensor(b["prompt_logprobs"]), torch.tensor(a["prompt_logprobs"]))
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    if quantization:
        assert not calls
    else:
        assert calls and len(calls) % (2 * layers) == 0  # two products a layer, every forward


def test_sums_before_norms_defer_all_or_none(tiny_model):
    """One sum that cannot defer (here a biased product) keeps every other one of the model, the MoE blocks
    too, on the plain all-reduce: a fused norm before a plain one would leave it half the residual's rows stale."""
    llm = LLM(str(tiny_model("qwen3-moe")), dtype="float32", device="cpu")
    try:
        model = llm.engine.runner.model
        sums = [module for layer in model.layers for module in layer.sums_before_norms()]
        assert len(sums) == 2 * len(model.layers) and all(module.defer_sum for module in sums)
        down = model.layers[1].mlp.down_proj  # (the dense layer's)
        down.bias = torch.nn.Parameter(torch.zeros(down.weight.shape[0]), requires_grad=False)
        model.agree_on_deferred_sums()
        assert not any(module.defer_sum for module in sums)
    finally:
        llm.close()


def test_penalized_and_biased_rows_match_tp1(tiny_model):
    """Rows with penalties, min-p, logit_bias, bad_words or allowed_token_ids beside plain sampled rows, squeezed:
    rank 0 adjusts the gathered logits and samples (no row takes the shards' sampling), the others follow its
    tokens."""
    model_dir = tiny_model("llama")
    extras = [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0, "presence_penalty": 0.5}, {"min_p": 0.2},
              {"logit_bias": {"7": 5.0}, "bad_words": ["the", "fox"]}, {"allowed_token_ids": [3, 5, 7, 11]}, {}]
    rows = [{"prompt_token_ids": p, "seed": i, **extra} for i, (p, extra) in enumerate(zip(prompts(), extras))]
    sampling = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    single, double = [generate(model_dir, tp, rows, sampling, **SQUEEZED) for tp in (1, 2)]
    assert all(r["error"] is None for r in single + double)
    assert_same_tokens(model_dir, rows, single, double)
    assert set(double[4]["output_token_ids"]) <= {3, 5, 7, 11}
