"""The e4m3 format as batchgen rounds to it: its constants and the torch definitions of rounding
activations (per token, per group of 128 columns, or with a static scale) and quantizing weights (per
output channel, or per 128x128 block). Every fp8 kernel (kernels/fp8_gemm.py, the norm that rounds in
kernels/rmsnorm.py) is checked against these, and the CPU's fp8 products round with them.

    s[t] = max(amax_k |x[t, k]|, MIN_AMAX) / 448      q[t, k] = e4m3(x[t, k] / s[t])
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # a row of zeros still gets a scale above 0 (no 0 / 0)
GROUP = 128  # the block form's K group (and N block) of published checkpoints


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def quantize_ref(x: torch.Tensor, scale: torch.Tensor | None = None, group: int | None = None,
                 silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] e4m3, scales fp32): per token [T, 1] (scale None, group None), per group of
    `group` columns [T, ceil(K / group)], or the static scale given (returned as is). silu_mul: x is a
    gate/up pair [T, 2K] and silu(gate) * up is rounded."""
    x = silu_mul_ref(x) if silu_mul else x.float()
    if scale is not None:
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    T, K = x.shape
    g = group or K
    pad = (-K) % g
    xg = torch.nn.functional.pad(x, (0, pad)).view(T, -1, g)
    s = xg.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX  # [T, groups]
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(T, -1)[:, :K]
    return q, s


def round_ref(x: torch.Tensor, scale: torch.Tensor | None = None, group: int | None = None,
              silu_mul: bool = False) -> torch.Tensor:
    """x rounded to e4m3 as quantize_ref rounds it, and scaled back: fp32 [T, K] (the CPU's products
    take their activations this way)."""
    q, s = quantize_ref(x, scale, group, silu_mul)
    if s.dim() == 2 and s.shape[1] > 1:  # per group: each scale over its group's columns
        s = s.repeat_interleave(group, dim=1)[:, : q.shape[1]]
    return q.float() * s


def dequantize_weight_ref(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 W [N, K] times its scales, fp32: one per tensor, per output channel ([N] or a checkpoint's
    [N, 1]), or per 128x128 block [ceil(N/128), ceil(K/128)] (told from [N, 1] by its shape, not its size)."""
    if weight_scale.numel() == 1:
        return weight.float() * weight_scale.float().reshape(())
    if weight_scale.dim() == 1 or tuple(weight_scale.shape) == (weight.shape[0], 1):
        return weight.float() * weight_scale.float().reshape(-1, 1)
    ws = weight_scale.float().repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
    return weight.float() * ws[: weight.shape[0], : weight.shape[1]]


def quantize_weight_ref(weight: torch.Tensor, block: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], scale fp32): per output channel [N], or per 128x128 block [N/128, K/128]
    (rounded up), scale = amax / 448 (the published forms' and vLLM's)."""
    w = weight.float()
    if not block:
        s = w.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
        return (w / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s
    N, K = w.shape
    pn, pk = (-N) % GROUP, (-K) % GROUP
    wb = torch.nn.functional.pad(w, (0, pk, 0, pn)).view((N + pn) // GROUP, GROUP, (K + pk) // GROUP, GROUP)
    s = wb.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (wb / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(N + pn, K + pk)[:N, :K]
    return q.contiguous(), s
