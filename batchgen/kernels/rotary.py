"""Rotary position embedding (NeoX / HF "rotate_half" layout), applied in place to q and k.

For a head vector x = [x1, x2] (two halves of head_dim/2) at position p:
    x' = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin],   cos, sin = cos_sin_cache[p] (fp32)
Rope scaling (llama3, linear) is folded into the cache when it is built (layers/rotary.py).
"""
import torch


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (modified in place); positions: [T]; cos_sin_cache: [P, D] fp32
    holding cos in its first D/2 columns and sin in the last D/2."""
    apply_rotary_ref(q, k, positions, cos_sin_cache)
