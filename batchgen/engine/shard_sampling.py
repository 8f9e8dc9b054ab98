"""Sampling from vocabulary shards under tensor parallelism.

The LM head is vocabulary-parallel (layers/embedding.py): rank r holds the logits of token ids
[r * V/tp, (r + 1) * V/tp). The general path gathers the whole [S, V] logits onto every rank, rank 0
samples and broadcasts the tokens. At 256 rows of a 128k vocabulary (llama-3.1-8b at TP=2, 2xH200)
that is ~115 us of all-gather, ~70 us of concatenation and conversion, and ~90 us of sampling on
rank 0 while the other ranks wait, each step (benchmarks/KERNELS.md).

Where a step only needs the Gumbel-max token (no logprobs, top-k/top-p, masks or banned ids), each
rank instead takes the best group score of its own shard and the token drawn in that group
(kernels/gumbel_argmax.gumbel_max: a shard is whole groups, layers/embedding.py, and the noise of a
group or token is a function of its id, so every rank scores its groups as the whole-vocabulary
kernel would), the ranks all-gather those [2, S] pairs, and every rank picks each row's best (ties:
the lowest rank, whose ids are the lowest, as argmax takes the first). Every rank then has the tokens. The rows'
sampling parameters come from rank 0 in one small broadcast.

Rank 0 decides per step (samples_from_shards) and the decision travels in the step's inputs, so
every rank takes the same path.
"""
from __future__ import annotations

import torch

from batchgen.kernels.gumbel_argmax import gumbel_max
from batchgen.layers.sampler import SamplingBatch

SAMPLE_FROM_SHARDS = True  # False: every step gathers the logits (the general path)


def samples_from_shards(tp_size: int, samplers: list, scored: list) -> bool:
    """Rank 0: whether a step's samplers need nothing but each row's Gumbel-max token."""
    if tp_size == 1 or not SAMPLE_FROM_SHARDS or scored or not samplers:
        return False
    return all(
        s.structured is None and s.logprobs is None and s.num_top_logprobs == 0 and not s.params.truncates
        # min_tokens bans stop ids until then; a sequence only gains tokens before its sampling
        and not (s.num_generated < s.params.min_tokens and s.stop_ids)
        for s in samplers
    )


def sampling_parameters(sb: SamplingBatch, num_rows: int, device: torch.device) -> torch.Tensor:
    """Rank 0: the rows' [seeds, steps, temperature bits] as one [3, S] int64 tensor to broadcast."""
    if sb.all_greedy:
        return torch.zeros((3, num_rows), dtype=torch.int64, device=device)
    steps = sb.steps + sb.step_offset if sb.step_offset else sb.steps
    return torch.stack([sb.seeds, steps, sb.temperatures.view(torch.int32).to(torch.int64)])


def tokens_from_shards(tp, logits: torch.Tensor, parameters: torch.Tensor, token_offset: int) -> torch.Tensor:
    """logits [S, V'] fp32: this rank's shard, token ids token_offset + [0, V'); parameters [3, S]
    (sampling_parameters) -> the tokens [S] int64, the same on every rank."""
    seeds, steps, temperature_bits = parameters
    temperatures = temperature_bits.to(torch.int32).view(torch.float32)
    best, ids = gumbel_max(logits, temperatures, seeds, steps, token_offset)
    every = tp.all_gather(torch.stack([best.view(torch.int32).to(torch.int64), ids]))  # [tp, 2, S]
    winner = every[:, 0].to(torch.int32).view(torch.float32).argmax(dim=0)  # the first best rank
    return every[:, 1].gather(0, winner[None]).squeeze(0)
