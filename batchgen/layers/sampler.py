"""Sampling for the whole batch at once, on the device.

Greedy rows take argmax. Other rows use the Gumbel-max trick with counter-based noise:
    token = argmax(logits / T + g),   g = -log(-log(u)),   u = hash(seed, step, token id)
so a request's samples depend only on its own seed and step, never on what else is in the batch,
and a preempted request that is recomputed draws the same tokens again. Top-k and top-p mask the
logits (to -inf) before the noise is added.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors holding values < 2^32 (products stay < 2^63)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), [S, V] fp32, a pure function of (seed, step, token id)."""
    key = hash32((seeds & _M32) ^ hash32(((seeds >> 32) & _M32) ^ hash32(steps & _M32)))  # [S]
    token_key = hash32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x9E3779B9)
    bits = hash32(key[:, None] ^ token_key[None, :]) >> 8  # 24 random bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def mask_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the smallest prefix whose probability mass reaches
    top_p; the rest become -inf. top_ks [S] (vocab size = off), top_ps [S] (1.0 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


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
    greedy = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy
    scaled = logits / torch.where(sb.temperatures > 0, sb.temperatures, 1.0)[:, None]
    if sb.use_top_k_top_p:
        scaled = mask_top_k_top_p(scaled, sb.top_ks, sb.top_ps)
    gumbel = -torch.log(-torch.log(uniform_noise(sb.seeds, sb.steps, logits.shape[-1])))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(sb.temperatures > 0, sampled, greedy)
