"""Sampling from vocabulary shards under tensor parallelism (executor/sampling.py): the shards'
best scores combine into the whole vocabulary's token (ties to the lowest id, shards of padding
never chosen), and at TP=2 the engine gives the same tokens as with the gathered logits, taking the
shard path only for steps that need nothing but the Gumbel-max token."""
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine import step_plan
from batchgen.executor import sampling as sampling_module
from batchgen.executor.sampling import samples_from_shards, tokens_from_shards
from batchgen.kernels.gumbel_argmax import GROUP, gumbel_argmax, gumbel_max
from batchgen.layers.embedding import vocab_rows_per_rank
from tests.tiny_models import VOCAB

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class RanksOf:
    """A tensor-parallel group of `size` ranks simulated in one process: rank r's all_gather returns
    every rank's tensor, each computed beforehand by running the same function as that rank."""

    def __init__(self, size):
        self.size, self.sent = size, []

    def all_gather(self, x):
        self.sent.append(x)
        return torch.stack(self.sent) if len(self.sent) == self.size else x[None]


def combined_tokens(logits, temperatures, seeds, steps, size):
    """The vocabulary cut as layers/embedding.py cuts it (whole sampling groups a rank, padding past V)."""
    vocab = logits.shape[-1]
    per_rank = vocab_rows_per_rank(vocab, size)
    parameters = torch.stack([seeds, steps, temperatures.view(torch.int32).to(torch.int64)])
    ranks = RanksOf(size)
    for rank in range(size):
        start = rank * per_rank
        shard = logits[:, start : max(start, min(start + per_rank, vocab))]
        tokens = tokens_from_shards(ranks, shard, parameters, start)
    return tokens  # the last rank's: it saw every rank's pair


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("vocab", [5, 301, 4099])  # 5 at 4 ranks: the last rank's shard is all padding
def test_shards_give_the_whole_vocabularys_tokens(size, vocab):
    g = torch.Generator().manual_seed(vocab + size)
    logits = torch.randn(9, vocab, generator=g) * 2
    temperatures = torch.rand(9, generator=g) + 0.3
    temperatures[::3] = 0.0  # greedy rows
    logits[0, :] = 1.0  # greedy, every token tied: token 0
    logits[3, vocab // 2 :] = logits[3].max() + 1  # greedy, a tie across shards: the first
    logits[1, ::2] = float("-inf")  # masked entries
    seeds = torch.randint(0, 2**62, (9,), generator=g)
    steps = torch.randint(0, 10_000, (9,), generator=g)
    args = [t.to(DEVICE) for t in (logits, temperatures, seeds, steps)]
    want = gumbel_argmax(*args)
    assert torch.equal(combined_tokens(*args, size), want)
    assert want[0].item() == 0 and want[3].item() == vocab // 2


def test_shards_are_whole_groups():
    """A rank's first token id is a group's (a group split between ranks would be scored twice, with
    the same noise); at TP=1 the vocabulary is as it is."""
    for vocab in (5, 301, 4099, 128256, 151936, 50257):
        assert vocab_rows_per_rank(vocab, 1) == vocab
        for size in (2, 3, 4, 8):
            rows = vocab_rows_per_rank(vocab, size)
            assert rows % GROUP == 0 and rows * size >= vocab > (rows - GROUP) * size  # (the fewest such rows)
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="group"):
        gumbel_max(torch.zeros(2, 10, device=DEVICE), torch.ones(2, device=DEVICE), zeros, zeros, 3)


def run(model_dir, rows, sampling, from_shards, monkeypatch):
    """TP=2 on the tiny model -> (results, steps rank 0 sampled from shards)."""
    decide = samples_from_shards if from_shards else (lambda *a: False)
    monkeypatch.setattr(step_plan, "samples_from_shards", decide)  # rank 0 decides for all
    calls = []
    real = sampling_module.tokens_from_shards
    monkeypatch.setattr(sampling_module, "tokens_from_shards", lambda *a: calls.append(1) or real(*a))
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, tensor_parallel_size=2, max_num_seqs=4)
    try:
        return llm.generate_list(rows, sampling), len(calls)
    finally:
        llm.close()


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs 2 GPUs (or none: gloo)")
def test_tp2_tokens_equal_the_gathered_paths(tiny_model, monkeypatch):
    """Seeded sampled rows beside greedy ones: the same tokens either way; a row that asks for logprobs
    makes its steps gather the logits again."""
    rng = random.Random(0)
    rows = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(n)], "seed": i,
             **({"temperature": 0.0} if i % 3 == 0 else {})} for i, n in enumerate([3, 17, 40, 5, 29])]
    sampling = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    model_dir = tiny_model("qwen2")
    gathered, none = run(model_dir, rows, sampling, False, monkeypatch)
    sharded, steps = run(model_dir, rows, sampling, True, monkeypatch)
    assert none == 0 and steps > 0
    assert [r["output_token_ids"] for r in sharded] == [r["output_token_ids"] for r in gathered]
    with_logprobs = [{**rows[0], "logprobs": True}, *rows[1:]]
    results, fewer = run(model_dir, with_logprobs, sampling, True, monkeypatch)
    assert 0 < fewer < steps  # the steps after that row ended sampled from shards again
    assert [r["output_token_ids"] for r in results] == [r["output_token_ids"] for r in gathered]
