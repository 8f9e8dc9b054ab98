"""Sampling: seeded results independent of the batch, top-k/top-p stay in their sets, stop strings,
min_tokens, EOS."""
import dataclasses

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.executor.sampling import SamplingBatch, mask_top_k_top_p, sample
from batchgen.kernels.gumbel_argmax import _row_keys, _uniform_at


def sampling_batch(n, temperature=1.0, top_k=None, top_p=1.0, seeds=None, vocab=50):
    return SamplingBatch(
        temperatures=torch.full((n,), temperature),
        top_ks=torch.full((n,), top_k or vocab, dtype=torch.int64),
        top_ps=torch.full((n,), top_p),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
        steps=torch.zeros(n, dtype=torch.int64),
        all_greedy=temperature == 0,
        use_top_k_top_p=top_k is not None or top_p < 1.0,
    )


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The sampler's u in (0, 1), [S, V] fp32, at every token id."""
    return _uniform_at(_row_keys(seeds, steps)[:, None], torch.arange(vocab_size)[None, :])


def test_noise_is_uniform_and_a_function_of_seed_and_step_only():
    u = uniform_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 5]), 100_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.01
    again = uniform_noise(torch.tensor([7, 1]), torch.tensor([3, 0]), 100_000)
    assert torch.equal(again[1], u[0])  # same (seed, step): same noise, wherever the row sits
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None].repeat(20_000, 1)
    tokens = sample(logits, sampling_batch(20_000, vocab=3))
    freq = torch.bincount(tokens, minlength=3).float() / 20_000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.015)


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (1.0, 5)])
def test_sampled_tokens_also_into_a_kept_buffer(temperature, top_k):
    """keep (the next decode graph's pending tokens) receives the tokens on every path: greedy,
    Gumbel-max (its kernel writes them) and top-k; a step offset draws as the offset steps do."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    sb = sampling_batch(6, temperature=temperature, top_k=top_k)
    keep = torch.full((9,), -1, dtype=torch.int64)
    tokens = sample(logits, sb, keep)
    assert torch.equal(keep[:6], tokens) and keep[6:].tolist() == [-1] * 3
    if temperature:
        later = sample(logits, dataclasses.replace(sb, step_offset=7))
        assert torch.equal(later, sample(logits, dataclasses.replace(sb, steps=sb.steps + 7)))


def test_top_k_never_picks_outside_the_k_largest():
    torch.manual_seed(0)
    logits = torch.randn(2_000, 50)
    tokens = sample(logits, sampling_batch(2_000, temperature=2.0, top_k=3))
    allowed = logits.topk(3, dim=-1).indices
    assert (allowed == tokens[:, None]).any(-1).all()
    assert len(set(tokens.tolist())) > 3  # rows differ, so many distinct tokens overall


def test_top_p_never_picks_outside_the_nucleus():
    torch.manual_seed(1)
    logits = torch.randn(2_000, 50) * 3
    tokens = sample(logits, sampling_batch(2_000, top_p=0.5))
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    in_nucleus = (sorted_p.cumsum(-1) - sorted_p) < 0.5
    chosen_rank = (order == tokens[:, None]).float().argmax(-1)
    assert in_nucleus.gather(1, chosen_rank[:, None]).all()


def test_top_k_top_p_mask_keeps_the_expected_sets():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    kept = mask_top_k_top_p(logits, torch.tensor([1.0]), torch.tensor([3]), torch.tensor([0.6])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(8, 50)
    sb = sampling_batch(8, temperature=1.0)
    sb.temperatures[::2] = 0.0
    tokens = sample(logits, sb)
    assert torch.equal(tokens[::2], logits.argmax(-1)[::2])


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), max_num_seqs=8)


def test_same_seed_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10)
    target = {"id": "t", "prompt_token_ids": [5, 6, 7], "seed": 1234}
    alone = llm.generate_list([target], params)[0]["output_token_ids"]
    others = [{"id": i, "prompt_token_ids": list(range(3, 3 + i)), "seed": i} for i in range(1, 7)]
    crowded = llm.generate_list(others[:3] + [target] + others[3:], params)[3]["output_token_ids"]
    assert alone == crowded
    other_seed = llm.generate_list([{**target, "seed": 99}], params)[0]["output_token_ids"]
    assert other_seed != alone


def test_rows_without_seed_get_one_from_the_job_seed_and_id(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10)
    rows = [{"id": "a", "prompt_token_ids": [1, 2]}, {"id": "b", "prompt_token_ids": [1, 2]}]
    first, second = llm.generate_list(rows, params), llm.generate_list(rows[::-1], params)[::-1]
    assert [r["output_token_ids"] for r in first] == [r["output_token_ids"] for r in second]
    assert first[0]["output_token_ids"] != first[1]["output_token_ids"]


def test_stop_string_cuts_the_text(llm):
    row = {"id": 0, "prompt_token_ids": [10, 20, 30]}
    full = llm.generate_list([row], SamplingParams(temperature=0, max_tokens=16))[0]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    cut = llm.generate_list([{**row, "stop": [stop]}], SamplingParams(temperature=0, max_tokens=16))[0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.find(stop)]
    assert stop not in cut["text"]
    assert cut["output_token_ids"] == full["output_token_ids"][: len(cut["output_token_ids"])]


@pytest.mark.parametrize("where,min_tokens", [("late", 0), ("early", 40)])
def test_stop_string_late_in_a_long_output(llm, where, min_tokens):
    """The engine looks for stop strings in the text of the newest tokens only, and decodes the
    whole text when one may be there: the result must be what a whole-text search at every step
    gives, for a stop string that first shows late in a long output, and for one that showed early
    but counts only once min_tokens is reached."""
    row = {"id": 0, "prompt_token_ids": [11, 22, 33], "seed": 3}  # seeded: the same tokens every run
    params = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True)
    ids = llm.generate_list([row], params)[0]["output_token_ids"]
    decode = llm.engine.finish.decode
    full, tail = decode(ids), decode(ids[min_tokens // 2 :])
    windows = [full[i : i + 3] for i in range(len(full) - 2) if full[i : i + 3].isalnum()]
    if where == "late":  # the last one whose first occurrence is in the second half
        stop = next(w for w in reversed(windows) if full.find(w) >= len(full) // 2)
    else:  # one of the first characters that the text never shows again
        stop = next(w for w in windows if full.find(w) < 12 and w not in tail)
    n = next(n for n in range(max(min_tokens, 1), len(ids) + 1) if stop in decode(ids[:n]))
    assert n > 24 and (where == "late" or n == min_tokens)
    text = decode(ids[:n])
    got = llm.generate_list([{**row, "stop": stop, "min_tokens": min_tokens}], params)[0]
    assert (got["finish_reason"], got["text"]) == ("stop", text[: text.find(stop)])
    assert got["output_token_ids"] == ids[:n]


def test_stop_token_ids_min_tokens_and_ignore_eos(llm):
    row = {"id": 0, "prompt_token_ids": [10, 20, 30]}
    greedy = SamplingParams(temperature=0, max_tokens=12)
    full = llm.generate_list([row], greedy)[0]["output_token_ids"]
    stop_at = full[4]
    first = full.index(stop_at)
    r = llm.generate_list([{**row, "stop_token_ids": [stop_at]}], greedy)[0]
    assert r["finish_reason"] == "stop" and r["output_token_ids"] == full[: first + 1]
    # min_tokens forbids the stop token until enough tokens exist, so generation takes another path
    r = llm.generate_list([{**row, "stop_token_ids": [stop_at], "min_tokens": first + 2}], greedy)[0]
    assert stop_at not in r["output_token_ids"][: first + 2] and r["completion_tokens"] >= first + 2
    r = llm.generate_list([{**row, "stop_token_ids": [stop_at], "ignore_eos": True}], greedy)[0]
    assert r["finish_reason"] == "stop"  # ignore_eos drops EOS only, not explicit stop tokens


def test_kept_sampling_parameters_give_the_tokens_of_fresh_ones(llm, monkeypatch):
    """Steps whose samplers are the last step's sequences, one token further, keep that step's
    parameters on the device and advance their step counters: the same tokens as parameters staged
    afresh every step, through finishes, joins and a min_tokens ban."""
    from batchgen.executor.sampling import KeptSampling

    rows = [{"id": i, "prompt_token_ids": list(range(2, 4 + i)), "seed": 10 + i, "max_tokens": 4 + 3 * i}
            for i in range(5)]
    rows[2]["min_tokens"] = 6
    params = SamplingParams(temperature=0.9, top_k=20)
    follows, kept = KeptSampling.follows, []
    monkeypatch.setattr(KeptSampling, "follows", lambda self, *a: kept.append(follows(self, *a)) or kept[-1])
    got = [r["output_token_ids"] for r in llm.generate_list(rows, params)]
    assert kept.count(True) > 5 and kept.count(False) > 0  # both paths ran
    monkeypatch.setattr(KeptSampling, "follows", lambda self, *a: False)
    assert got == [r["output_token_ids"] for r in llm.generate_list(rows, params)]


def test_kept_sampling_parameters_equal_staged_ones(llm):
    from types import SimpleNamespace

    sampler = llm.engine.runner.sampler
    seqs = [SimpleNamespace(params=SamplingParams(temperature=t, top_p=p, seed=s), num_generated=g, stop_ids=[0])
            for t, p, s, g in [(0.7, 1.0, 3, 0), (1.3, 0.8, 4, 5)]]

    def fields(sb):
        return [sb.temperatures, sb.top_ks, sb.top_ps, sb.seeds, sb.steps + sb.step_offset]

    first = sampler.parameters(seqs)
    for s in seqs:
        s.num_generated += 1
    again = sampler.parameters(seqs)  # the same tensors, one step further: nothing copied, no op
    assert again.steps is first.steps and again.seeds is first.seeds and again.steps.tolist() == [0, 5]
    assert again.step_offset == 1
    sampler._kept = None
    for got, want in zip(fields(again), fields(sampler.parameters(seqs))):
        assert torch.equal(got, want)
    seqs[0].num_generated += 2  # not one token further: staged afresh
    fresh = sampler.parameters(seqs)
    assert fresh.steps is not first.steps and fresh.steps.tolist() == [3, 6] and fresh.step_offset == 0
    for s in seqs:
        s.num_generated += 1
    swapped = sampler.parameters(seqs[::-1])  # one token further, in another order: staged afresh
    assert swapped.steps is not fresh.steps and swapped.steps.tolist() == [7, 4] and swapped.seeds.tolist() == [4, 3]


def test_cpu_top_k_top_p_keeps_the_sorted_versions_sets():
    """The CPU path (the largest logits only where they settle a row, else a sort) against sorting
    whole rows: the same sets, flat rows and large top_k included, ties (logits rounded to bf16) taken
    in token order; a row's set does not depend on the rest of the batch."""
    from batchgen.executor.sampling import mask_top_k_top_p_cpu, mask_top_k_top_p_sorted

    top_ks = torch.tensor([3001, 5, 64, 70, 200, 3001, 3001, 1, 3001, 10, 3001, 2000])
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 0.3, 0.999, 0.7, 1.0, 1.0, 0.05, 0.8])
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(12, 3001, generator=g) * 3
        if seed % 2:
            logits = logits.bfloat16().float()  # ties, as a bf16 model's logits have them
        logits[0, ::3] = float("-inf")  # masked entries (a grammar)
        temperatures = torch.rand(12, generator=g) * 4 + 0.05  # up to flat rows: nuclei of thousands
        temperatures[1] = 0.0
        got = mask_top_k_top_p_cpu(logits, temperatures, top_ks, top_ps).isfinite()
        want = mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps).isfinite()
        assert torch.equal(got, want)
        assert torch.equal(got[8], logits[8].isfinite()) and got[9].sum() == 10
        for i in (2, 4, 11):
            alone = mask_top_k_top_p_cpu(logits[i : i + 1], temperatures[i : i + 1], top_ks[i : i + 1],
                                         top_ps[i : i + 1]).isfinite()
            assert torch.equal(alone[0], got[i])


def test_cpu_top_k_top_p_edges():
    """Large logits (the normaliser's rounding must not move the nucleus), top_k alone (top_p 1 keeps
    all k), and a temperature so small that the scaled logits overflow (as the sorted version does)."""
    from batchgen.executor.sampling import mask_top_k_top_p_cpu, mask_top_k_top_p_sorted

    logits = torch.tensor([[1250.906982421875, 1248.7099609375, -1e4, -1e4]] * 3)  # p0 = 0.89998 < top_p
    temperatures = torch.tensor([1.0, 0.3, 1e-40])
    args = (logits, temperatures, torch.tensor([3, 3, 4]), torch.tensor([0.9, 1.0, 0.9]))
    got, want = mask_top_k_top_p_cpu(*args).isfinite(), mask_top_k_top_p_sorted(*args).isfinite()
    assert got[0].tolist() == [True, True, False, False] and got[1].tolist() == [True, True, True, False]
    assert torch.equal(got, want)


def test_log_normaliser_without_subnormals_matches_torch():
    from batchgen.executor.sampling import _log_normaliser

    x = (torch.randn(5, 4000, generator=torch.Generator().manual_seed(3))
         * torch.tensor([1.0, 30, 300, 3000, 1])[:, None])
    x[1, ::2] = float("-inf")  # masked entries
    x[4] = float("-inf")  # a row masked entirely
    top, log_sum = _log_normaliser(x)
    want = torch.logsumexp(x, dim=-1)
    assert top[4] + log_sum[4] == want[4] == float("-inf")
    torch.testing.assert_close(top[:4] + log_sum[:4], want[:4], rtol=1e-6, atol=0)


PLAIN_ROWS = [({}, True), ({"temperature": 0.0}, True), ({"logprobs": True}, False), ({"top_logprobs": 2}, False),
              ({"prompt_logprobs": True}, False), ({"top_k": 5}, False), ({"top_p": 0.9}, False),
              ({"min_tokens": 2}, False), ({"response_format": {"type": "json_object"}}, False)]


@pytest.mark.parametrize("fields,plain", PLAIN_ROWS)
def test_which_steps_sample_from_16_bit_logits(llm, fields, plain):
    """A GPU step whose samplers only sample their logits (argmax or Gumbel-max) has them in the model's
    16-bit dtype, as HF transformers' and vLLM's LM heads make them; log-probabilities, top-k/top-p,
    min_tokens' banned tokens, a grammar's mask or prompt logprobs (scored tokens) keep fp32. Never on a
    CPU, a fp32 model or across tensor-parallel ranks."""
    from types import SimpleNamespace

    from batchgen.executor.model_runner import ModelRunner
    from batchgen.parallel.tensor_parallel import SINGLE

    engine = llm.engine
    defaults = SamplingParams(temperature=0.7, max_tokens=4)
    seq, other = (engine.sequences(prepared, [0])[0] for prepared in engine.request_preparer(defaults)(
        [{"id": 0, "prompt_token_ids": [1, 2, 3], **fields}, {"id": 1, "prompt_token_ids": [4, 5]}]))
    assert seq.plain_sampling is plain and other.plain_sampling
    def runner(dtype=torch.bfloat16, device="cuda", tp=SINGLE, batch_invariant=False):
        return SimpleNamespace(dtype=dtype, device=torch.device(device), tp=tp,
                               config=SimpleNamespace(batch_invariant=batch_invariant))

    gpu = runner()
    assert ModelRunner.logits_dtype(gpu, [other, seq], []) == (torch.bfloat16 if plain else torch.float32)
    assert ModelRunner.logits_dtype(gpu, [other], [(seq, 1, [2])]) == torch.float32  # a prompt scored
    # (--batch-invariant: a row's logits dtype must not follow the other rows of its step)
    for fp32_runner in (runner(device="cpu"), runner(dtype=torch.float32), runner(tp=SimpleNamespace(size=2)),
                        runner(batch_invariant=True)):
        assert ModelRunner.logits_dtype(fp32_runner, [other], []) == torch.float32


def test_whole_row_sort_in_row_chunks_gives_the_same_masks(monkeypatch):
    """mask_top_k_top_p_sorted sorts SORT_ROWS rows at a time (its temporaries bounded however many rows a step
    samples): with chunks of 1, 3 and 5 rows (a last one short) the masked logits are those of one sort of all."""
    from batchgen.executor import sampling

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(11, 500, generator=g) * 3).bfloat16().float()  # (ties)
    temperatures = torch.rand(11, generator=g) * 2 + 0.05
    top_ks = torch.tensor([500, 5, 64, 1, 200, 500, 7, 500, 30, 10, 499])
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 0.3, 0.999, 0.7, 1.0, 1.0, 0.05])
    whole = sampling.mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps)
    assert whole.isfinite().sum() < whole.numel() // 2  # (the limits do mask)
    for rows in (1, 3, 5):
        monkeypatch.setattr(sampling, "SORT_ROWS", rows)
        assert torch.equal(sampling.mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps), whole)


def test_tiny_temperatures_and_top_ps_sample_the_greedy_token(llm):
    """A temperature below MIN_TEMPERATURE samples greedily (logits / 1e-40 overflow fp32: before, such rows
    gave other tokens, and 1e-45 token 0 every step); a top_p that rounds to 0 in fp32 keeps the most likely
    token (before, it masked every token). Alone and beside an ordinary sampled row."""
    prompt = [5, 6, 7]
    greedy = llm.generate_list([{"id": "g", "prompt_token_ids": prompt}],
                               SamplingParams(temperature=0.0, max_tokens=6))[0]["output_token_ids"]
    params = SamplingParams(temperature=1.0, max_tokens=6)
    rows = [{"id": "t40", "prompt_token_ids": prompt, "temperature": 1e-40},
            {"id": "t45", "prompt_token_ids": prompt, "temperature": 1e-45},
            {"id": "t6", "prompt_token_ids": prompt, "temperature": 1e-6},
            {"id": "p", "prompt_token_ids": prompt, "top_p": 1e-300, "seed": 3},
            {"id": "other", "prompt_token_ids": [9, 8], "seed": 1}]
    results = llm.generate_list(rows, params)
    assert all(r["error"] is None for r in results)
    assert [r["output_token_ids"] for r in results[:4]] == [greedy] * 4
    for temperature in (1e-40, 0.0):
        alone = llm.generate_list([{**rows[0], "temperature": temperature}], params)[0]["output_token_ids"]
        assert alone == greedy


def test_a_top_p_of_zero_keeps_the_first_token():
    from batchgen.executor.sampling import mask_top_k_top_p_cpu, mask_top_k_top_p_sorted

    logits = torch.tensor([[0.5, 3.0, 1.0, 3.0], [2.0, 1.0, 0.0, -1.0]])
    args = (logits, torch.ones(2), torch.tensor([4, 4]), torch.tensor([0.0, 0.0]))
    for mask in (mask_top_k_top_p_sorted, mask_top_k_top_p_cpu):
        assert mask(*args).isfinite().tolist() == [[False, True, False, False], [True, False, False, False]]
