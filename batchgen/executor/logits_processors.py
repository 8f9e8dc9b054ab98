"""A row's own changes to its logits before sampling, in vLLM's order, in place on a step's logits:

    allowed_token_ids A:                -inf for every token not in A
    logit_bias B:                       logit += B[t] for each t in B
    bad_words W (token ids w):          -inf for w's last token where the output ends with w's others
    repetition (r != 1), t in P or O:   logit = logit / r if logit > 0 else logit * r
    frequency f, presence p, t in O:    logit -= f * c(t) + p

(P, O: the row's prompt and output tokens so far, c(t): t's count in O), then temperature, min-p, top-k/top-p
and the draw as without them. Each depends on the row's own fields and tokens only (never on the batch's
others): sparse (row, token) indices, no [rows, V] tensor.
"""
from __future__ import annotations

import numpy as np
import torch


def apply_allowed_and_bias(logits: torch.Tensor, samplers: list, to_device) -> None:
    """allowed_token_ids and logit_bias of the samplers that have them; logits [S', V] fp32, rows 0.. the
    samplers'; to_device(arrays, dtype) -> device tensors (the step's staging)."""
    allowed = [(i, s.params.allowed_token_ids) for i, s in enumerate(samplers) if s.params.allowed_token_ids]
    biased = [(i, s.params.logit_bias) for i, s in enumerate(samplers) if s.params.logit_bias]
    if allowed:
        rows, tokens = to_device([[i for i, ids in allowed for _ in ids], [t for _, ids in allowed for t in ids]],
                                 torch.int64)
        kept = logits[rows, tokens]
        logits[rows.unique()] = float("-inf")
        logits[rows, tokens] = kept
    if biased:
        rows, tokens = to_device([[i for i, bias in biased for _ in bias], [t for _, bias in biased for t in bias]],
                                 torch.int64)
        (bias,) = to_device([[b for _, bias in biased for b in bias.values()]], torch.float32)
        logits.index_put_((rows, tokens), bias, accumulate=True)


def apply_bad_words(logits: torch.Tensor, samplers: list, to_device) -> None:
    """vLLM's bad words: each word's last token banned where the row's output ends with the word's other
    tokens (a one-token word: always). samplers' bad_words_ids: lists of token ids (their tokens known)."""
    rows, tokens = [], []
    for i, seq in enumerate(samplers):
        for word in seq.bad_words_ids or ():
            before = len(word) - 1
            if before == 0 or (len(seq.token_ids) - seq.num_prompt >= before and seq.token_ids[-before:] == word[:-1]):
                rows.append(i)
                tokens.append(word[-1])
    if rows:
        rows, tokens = to_device([rows, tokens], torch.int64)
        logits[rows, tokens] = float("-inf")


def apply_penalties(logits: torch.Tensor, samplers: list, to_device) -> None:
    """logits [S', V] fp32, rows 0.. the samplers' (each with params, token_ids and num_prompt, its
    tokens all known on the host); to_device(arrays, dtype) -> device tensors (the step's staging)."""
    rows = [i for i, s in enumerate(samplers) if s.params.penalized]
    if not rows:
        return
    vocab = logits.shape[1]
    repeats, outputs = [], []
    for i in rows:
        seq = samplers[i]
        tokens = token_array(seq)
        if seq.params.repetition_penalty != 1.0:
            repeats.append(i * vocab + tokens)
        if seq.params.frequency_penalty != 0.0 or seq.params.presence_penalty != 0.0:
            outputs.append(i * vocab + tokens[seq.num_prompt:])
    per_row = [[s.params.repetition_penalty for s in samplers], [s.params.frequency_penalty for s in samplers],
               [s.params.presence_penalty for s in samplers]]
    repetition, frequency, presence = to_device(per_row, torch.float32)
    none = np.zeros(0, np.int64)
    keys = to_device([torch.from_numpy(np.concatenate(parts or [none])) for parts in (repeats, outputs)], torch.int64)
    if repeats:
        seen = torch.unique(keys[0])  # (a token once, however often it occurs)
        row, token = seen // vocab, seen % vocab
        values, r = logits[row, token], repetition[row]
        logits[row, token] = torch.where(values > 0, values / r, values * r)
    if outputs:
        seen, counts = torch.unique(keys[1], return_counts=True)
        row, token = seen // vocab, seen % vocab
        logits[row, token] -= frequency[row] * counts + presence[row]


def token_array(seq) -> np.ndarray:
    """seq.token_ids as an int64 array, kept on the sequence (`token_array`: the array, its count) and
    extended by the tokens added since: a step's penalties convert each row's new tokens only."""
    count = len(seq.token_ids)
    array, have = getattr(seq, "token_array", None) or (np.empty(0, np.int64), 0)
    if have != count:
        if count > len(array):
            grown = np.empty(max(2 * len(array), count), np.int64)
            grown[:have] = array[:have]
            array = grown
        array[have:count] = seq.token_ids[have:count]
        seq.token_array = (array, count)
    return array[:count]


def allowed_and_bias_reference(logits: torch.Tensor, allowed: list[int] | None,
                                bias: dict[int, float] | None) -> torch.Tensor:
    """The definition for one row's logits [V], in fp32 (tests)."""
    out = logits.float().clone()
    if allowed:
        out[[t for t in range(out.shape[0]) if t not in set(allowed)]] = float("-inf")
    for t, b in (bias or {}).items():
        out[t] += b
    return out


def penalties_reference(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float,
                        frequency: float, presence: float) -> torch.Tensor:
    """The definition for one row's logits [V], in fp32, token by token (tests)."""
    out = logits.float().clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out
