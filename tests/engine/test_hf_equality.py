"""Greedy output equals HF transformers generate() token for token on tiny random checkpoints, alone,
in a batch of mixed lengths, with a tiny token budget (chunked prefill) and a tiny KV pool
(preemption). A difference is tolerated only after a step where HF's top-2 logits were within 1e-3."""
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.tiny_models import EOS, VOCAB, load_hf

KINDS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
LENGTHS = [1, 3, 17, 40, 64, 29]
MAX_TOKENS = 12


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    """kind -> list of (tokens, per-step top-2 margins) from HF generate, one prompt at a time."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model = load_hf(tiny_model(kind))
            refs = []
            for p in prompts():
                ids = torch.tensor([p])
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                    output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                )
                tokens = out.sequences[0, len(p):].tolist()
                margins = [float(l[0].topk(2).values[0] - l[0].topk(2).values[1]) for l in out.logits]
                refs.append((tokens, margins))
            cache[kind] = refs
        return cache[kind]

    return get


def assert_matches_hf(results, refs):
    for result, (hf_tokens, margins) in zip(results, refs):
        ours = result["output_token_ids"]
        diverged = next((i for i, (a, b) in enumerate(zip(ours, hf_tokens)) if a != b), None)
        if diverged is None:
            assert ours == hf_tokens  # same tokens, and both stopped at EOS or both at max_tokens
            assert result["finish_reason"] == ("stop" if ours[-1] == EOS else "length")
        else:
            assert min(margins[: diverged + 1]) < 1e-3, f"token {diverged}: ours {ours} vs HF {hf_tokens}"


def run(model_dir, requests, **options):
    llm = LLM(str(model_dir), dtype="float32", **options)
    results = llm.generate_list(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert llm.engine.kv.num_available == llm.engine.kv.num_slots  # every slot free or only cached
    if "kv_cache_tokens" not in options:  # a pool with room for all: nothing is ever recomputed
        assert all(r["num_preemptions"] == 0 for r in results)
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_alone(kind, tiny_model, hf_reference):
    for p, ref in zip(prompts(), hf_reference(kind)):
        assert_matches_hf(run(tiny_model(kind), [{"prompt_token_ids": p}]), [ref])


@pytest.mark.parametrize("kind", KINDS)
def test_batch_of_mixed_lengths(kind, tiny_model, hf_reference):
    requests = [{"prompt_token_ids": p} for p in prompts()]
    assert_matches_hf(run(tiny_model(kind), requests), hf_reference(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_token_budget_chunks_prefill(kind, tiny_model, hf_reference):
    requests = [{"prompt_token_ids": p} for p in prompts()]
    results = run(tiny_model(kind), requests, max_num_seqs=4, max_num_batched_tokens=7)
    assert_matches_hf(results, hf_reference(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_kv_pool_preempts(kind, tiny_model, hf_reference):
    requests = [{"prompt_token_ids": p} for p in prompts()]
    results = run(tiny_model(kind), requests, kv_cache_tokens=90, max_num_seqs=8, max_num_batched_tokens=32)
    assert sum(r["num_preemptions"] for r in results) > 0
    assert_matches_hf(results, hf_reference(kind))


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_logprobs_equal_hf_teacher_forced(kind, tiny_model):
    """prompt_logprobs (scored over chunked prefill) and the sampled tokens' logprobs equal HF's."""
    model = load_hf(tiny_model(kind))
    seqs = prompts()
    llm = LLM(str(tiny_model(kind)), dtype="float32", max_num_seqs=4, max_num_batched_tokens=9)
    rows = [{"prompt_token_ids": p, "prompt_logprobs": True, "logprobs": True, "ignore_eos": True} for p in seqs]
    for p, r in zip(seqs, llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=4))):
        full = p + r["output_token_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
        expected = ref[:-1].gather(1, torch.tensor(full[1:])[:, None]).squeeze(1)
        assert len(r["prompt_logprobs"]) == len(p) - 1 and len(r["logprobs"]) == 4
        ours = torch.tensor(r["prompt_logprobs"] + r["logprobs"])
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model, hf_reference):
    sharded = tiny_model("llama-sharded")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    requests = [{"prompt_token_ids": p} for p in prompts()]
    assert_matches_hf(run(sharded, requests), hf_reference("llama"))
