"""The host's plan of one step: a ScheduledBatch -> the StepInputs every rank runs, the sequences that
sample a token (in logits order) and the prompt tokens scored for prompt_logprobs."""
from __future__ import annotations

import itertools

from batchgen.engine.request import Sequence
from batchgen.engine.scheduler import ScheduledBatch
from batchgen.executor.sampling import samples_from_shards
from batchgen.executor.step_inputs import StepInputs


def plan_step(batch: ScheduledBatch, tp_size: int) -> tuple[StepInputs, list[Sequence], list]:
    """-> (StepInputs, samplers, scored): scored is (sequence, count, target ids) of the prompt tokens
    scored, whose logits follow the samplers' in logits_indices. Input tokens that the step in flight
    is sampling are listed in pending_dst/pending_src."""
    nd = batch.num_decode
    rows = [s.row for s in batch.seqs]
    # Decodes first (one token each, always sampled, never scoring a prompt token): a tight loop.
    input_ids, positions, token_rows = [], batch.starts[:nd], rows[:nd]
    logits_indices, samplers = list(range(nd)), batch.seqs[:nd]
    scored, score_indices = [], []
    pending_dst, pending_src = [], []  # input tokens still on the device: (batch index, sample row)
    for i, (seq, start) in enumerate(zip(samplers, positions)):
        token_ids = seq.token_ids
        if start < len(token_ids):
            input_ids.append(token_ids[start])
        else:  # sampled by the step in flight: taken from its output on the device
            pending_dst.append(i)
            pending_src.append(seq.logits_row)
            input_ids.append(0)
    # Prefill chunks: all their tokens are on the host (a token still in flight is always a
    # sequence's last, so its sequence is a decode, and admission waits for read-backs).
    for seq, start, n in zip(batch.seqs[nd:], batch.starts[nd:], batch.num_new[nd:]):
        first = len(input_ids)
        assert start + n <= len(seq.token_ids), "a prefill chunk reaches a token still in flight"
        input_ids.extend(seq.token_ids[start : start + n])
        positions.extend(range(start, start + n))
        token_rows.extend([seq.row] * n)
        if start + n == seq.num_tokens:  # the chunk reaches the end: sample the next token
            logits_indices.append(first + n - 1)
            samplers.append(seq)
        if seq.prompt_logprobs is not None:
            # position p predicts prompt token p + 1; recomputation after preemption skips known ones
            lo, hi = max(start, seq.num_prompt_scored), min(start + n, seq.num_prompt - 1)
            if hi > lo:
                score_indices.extend(range(first + lo - start, first + hi - start))
                scored.append((seq, hi - lo, seq.token_ids[lo + 1 : hi + 1]))
                seq.num_prompt_scored = hi
    logits_indices += score_indices
    kv_lens = [start + n for start, n in zip(batch.starts, batch.num_new)]
    cu_q = [0, *itertools.accumulate(batch.num_new)]
    q_start = [c - nd for c in cu_q[nd:-1]]
    inputs = StepInputs.pack(
        [nd, len(samplers), max(kv_lens[:nd], default=0), max(batch.num_new[nd:], default=0),
         int(samples_from_shards(tp_size, samplers, scored))],
        [input_ids, positions, batch.slots, logits_indices, pending_dst, pending_src,
         batch.prefix_rows, batch.prefix_positions, batch.prefix_slots,
         token_rows, rows, kv_lens, q_start, batch.num_new[nd:], cu_q],
    )
    return inputs, samplers, scored
