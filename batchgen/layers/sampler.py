"""Sampling for the whole batch at once, on the device.

Greedy rows take argmax. Other rows use the Gumbel-max trick with counter-based noise
(kernels/gumbel_argmax.py): a request's samples depend only on its own seed and step, never on
what else is in the batch. Top-k and top-p mask the logits (to -inf) first, judged on the
temperature-scaled distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.gumbel_argmax import gumbel_argmax


def mask_top_k_top_p(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the smallest prefix whose probability mass (at the
    row's temperature) reaches top_p; the rest become -inf. top_ks [S] (vocab size = off), top_ps
    [S] (1.0 = off)."""
    scaled = logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    dropped = torch.isinf(sorted_logits) | (mass_before >= top_ps[:, None])
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), float("-inf"))


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


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [S, V] fp32 -> token ids [S] int64."""
    if sb.banned_rows is not None:
        logits = logits.index_put((sb.banned_rows, sb.banned_ids), torch.tensor(float("-inf"), device=logits.device))
    if sb.all_greedy:
        return logits.argmax(dim=-1)
    if sb.use_top_k_top_p:
        logits = mask_top_k_top_p(logits, sb.temperatures, sb.top_ks, sb.top_ps)
    return gumbel_argmax(logits, sb.temperatures, sb.seeds, sb.steps)
