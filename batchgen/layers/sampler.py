"""Sampling for the whole batch at once, on the device.

Greedy rows take argmax. Other rows use the Gumbel-max trick in two levels (a group of 8 token ids
by its mass, then a token in it) with counter-based noise (kernels/gumbel_argmax.py): a request's
samples depend only on its own seed and step, never on what else is in the batch. Top-k and top-p
mask the logits (to -inf) first, judged on the temperature-scaled distribution (equal logits in
token order). On a CPU both look only at the tokens or groups that can be chosen
(mask_top_k_top_p_cpu, kernels/gumbel_argmax.gumbel_argmax_cpu).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.gumbel_argmax import gumbel_argmax, temperature_scaled


TOP_RANKS_FIRST = 64  # ranks the CPU path looks at; a row they do not settle is sorted whole


def mask_top_k_top_p(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the smallest prefix whose probability mass (at the
    row's temperature) reaches top_p; the rest become -inf. top_ks [S] (vocab size = off), top_ps
    [S] (1.0 = off)."""
    if logits.is_cuda:  # (the CPU path decides on the host how far to look: no sync on a GPU)
        return mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps)
    return mask_top_k_top_p_cpu(logits, temperatures, top_ks, top_ps)


def mask_top_k_top_p_sorted(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """mask_top_k_top_p by sorting every row's whole vocabulary; equal logits in token order (a stable
    sort), so that which of them a limit keeps does not depend on the sort."""
    scaled = temperature_scaled(logits, temperatures)
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # (top_p 1 is off: a tail whose mass before it rounds to 1 stays)
    dropped = torch.isinf(sorted_logits) | ((mass_before >= top_ps[:, None]) & (top_ps < 1.0)[:, None])
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), float("-inf"))


def _largest(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, in the order of a stable descending sort (equal values in token
    order): torch.topk, whose choice among values tied at the k-th place is redone by token id where
    it left some out, then the k ordered by value, then id. (A stable sort where k nears the row.)"""
    if 4 * k >= scaled.shape[-1]:
        values, ids = scaled.sort(dim=-1, descending=True, stable=True)
        return values[:, :k], ids[:, :k]
    values, ids = scaled.topk(k, dim=-1)
    kth = values[:, -1:]
    cut = (scaled == kth).sum(dim=-1) > (values == kth).sum(dim=-1)  # rows with tied values left out
    if cut.any():
        part, kth = scaled[cut], kth[cut]
        above, tied = part > kth, part == kth
        take = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        ids[cut] = take.nonzero()[:, 1].view(-1, k)
    ids = ids.sort(dim=-1).values
    values, where = scaled.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, where)


def _log_normaliser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, log_sum), [R, n] -> two [R]: logsumexp(x) = top + log_sum, top the row's largest (0 if it
    is not finite), so that probabilities exp((x - top) - log_sum) keep fp32 precision however large
    the logits. Without subnormal exponentials: a term below e^-87 of the largest counts as e^-87
    (nothing at fp32 precision next to the largest's 1), a masked one (-inf) as 0; low temperatures
    spread the scaled logits so far that most exponentials were subnormal, far slower on a CPU."""
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    below = (x - top).clamp(min=-87.0).masked_fill(x == float("-inf"), float("-inf"))
    return top.squeeze(-1), below.exp().sum(dim=-1).log()


def mask_top_k_top_p_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """mask_top_k_top_p from each row's TOP_RANKS_FIRST largest logits, where that settles the row
    (its top_k is at most that, or its nucleus closes within them); the other rows through the sorted
    version. Sorting whole vocabularies was most of a CPU job's sampling time. Ties are ordered as the
    sorted version orders them. The mass is normalised by the row's (or its top_k's) log-sum-exp
    rather than summed in sorted order, so a set can differ from the sorted version's only where a
    token's mass before it is within fp32 rounding of top_p."""
    vocab = logits.shape[-1]
    scaled = temperature_scaled(logits, temperatures)
    if torch.isnan(scaled).any() or torch.isposinf(scaled).any():  # (no order or no mass to speak of)
        return mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps)
    top_ks = top_ks.clamp(max=vocab)
    k = min(vocab, TOP_RANKS_FIRST)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    unlimited = (top_ps >= 1.0) & (top_ks >= vocab)
    keep[unlimited] = torch.isfinite(logits[unlimited])
    rows = (~unlimited & ((top_ks <= k) | (top_ks >= vocab))).nonzero().squeeze(1)  # settled by one look, maybe
    values, order = _largest(scaled[rows], k)
    ks, ps = top_ks[rows], top_ps[rows]
    in_top_k = torch.arange(k)[None, :] < ks[:, None]
    # each row's normaliser from its own values (what else is in the batch changes nothing): the whole
    # row's, or its top_k's (at most k: among the values looked at)
    tops, sums = torch.zeros(rows.numel()), torch.zeros(rows.numel())
    whole = ks >= vocab
    if whole.any():
        tops[whole], sums[whole] = _log_normaliser(scaled[rows[whole]])
    if (~whole).any():
        tops[~whole], sums[~whole] = _log_normaliser(values[~whole].masked_fill(~in_top_k[~whole], float("-inf")))
    probs = ((values - tops[:, None]) - sums[:, None]).exp()
    kept = in_top_k & torch.isfinite(values) & ((probs.cumsum(dim=-1) - probs < ps[:, None]) | (ps >= 1.0)[:, None])
    done = ~kept[:, -1] | (ks <= k) | (k == vocab)  # the kept prefix ends among the ranks looked at
    keep[rows[done]] = torch.zeros((int(done.sum()), vocab), dtype=torch.bool).scatter(-1, order[done], kept[done])
    rest = ~unlimited
    rest[rows[done]] = False
    if rest.any():
        keep[rest] = mask_top_k_top_p_sorted(logits[rest], temperatures[rest], top_ks[rest], top_ps[rest]).isfinite()
    return logits.masked_fill(~keep, float("-inf"))


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor | None  # [S] fp32, 0 = greedy (None: all greedy)
    top_ks: torch.Tensor | None  # [S] int64, vocab size when off
    top_ps: torch.Tensor | None  # [S] fp32
    seeds: torch.Tensor | None  # [S] int64
    steps: torch.Tensor | None  # [S] int64, tokens generated so far
    all_greedy: bool
    use_top_k_top_p: bool
    banned_rows: torch.Tensor | None = None  # (rows, token ids) masked to -inf: EOS before min_tokens
    banned_ids: torch.Tensor | None = None
    step_offset: int = 0  # the rows' steps are steps + step_offset (kept parameters: no op on the device)


def sample(logits: torch.Tensor, sb: SamplingBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] fp32 (16-bit: argmax and Gumbel-max only) -> token ids [S] int64; also written into
    keep[:S] when given (the Gumbel-max kernel writes both: no copy on the step's stream)."""
    if sb.banned_rows is not None:
        logits = logits.index_put((sb.banned_rows, sb.banned_ids), torch.tensor(float("-inf"), device=logits.device))
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        if keep is not None:
            keep[: tokens.shape[0]].copy_(tokens)
        return tokens
    if sb.use_top_k_top_p:
        logits = mask_top_k_top_p(logits, sb.temperatures, sb.top_ks, sb.top_ps)
    return gumbel_argmax(logits, sb.temperatures, sb.seeds, sb.steps, sb.step_offset, keep)
