import torch
from torch import nn

from batchgen.kernels.head_rmsnorm import head_rmsnorm_
from batchgen.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_fp8, rmsnorm
from batchgen.kernels.skinny_gemm import normed_skinny_gemm, uses_tma
from batchgen.layers.linear import DeferredSum
from batchgen.layers.packed_linear import PackableWeight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(
        self, x: torch.Tensor | DeferredSum, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: rmsnorm(x). With it: (rmsnorm(x + residual), x + residual). x may be a
        row-parallel product's DeferredSum (partial sums of ranks, or split-K parts): one kernel sums
        them, adds and normalises."""
        if isinstance(x, DeferredSum):
            return x.add_rmsnorm(residual, self.weight, self.eps)
        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        return add_rmsnorm(x, residual, self.weight, self.eps)


def qk_rmsnorm_(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
    """Qwen3's q and k norms over each head of the qkv product's output [T, (Hq + 2 Hk) D], in place and in
    one launch on a GPU (kernels/head_rmsnorm.py)."""
    assert q_norm.eps == k_norm.eps
    head_rmsnorm_(qkv, num_q_heads, num_kv_heads, q_norm.weight, k_norm.weight, q_norm.eps)


def normed_product(
    norm: RMSNorm, x: torch.Tensor | DeferredSum, residual: torch.Tensor | None, linear: PackableWeight
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), or without a residual (linear(norm(x)), x). One
    launch where the product streams its weight with plain loads (one row on a GPU: the skinny kernel
    applies the norm as it reads x); an FP8 product with per-token activations gets its rows rounded by
    the norm's kernel (which also sums split-K parts); the norm's kernel, then the product, elsewhere
    (also for a row-parallel product's DeferredSum, which the norm sums, unless it is one fp32 part, and
    a weight read through TMA: kernels/skinny_gemm.py says why)."""
    # (the loader gives every weight the model's dtype: the skinny kernel asserts it)
    if linear.fp8 is not None and linear.fp8.takes_normed_rows(x if residual is None else residual):
        # (the norm rounds to e4m3; a DeferredSum whose form has no such kernel gives None)
        rounded = (x.add_rmsnorm_fp8(residual, norm.weight, norm.eps) if isinstance(x, DeferredSum)
                   else add_rmsnorm_fp8(x, residual, norm.weight, norm.eps))
        if rounded is not None:
            q, s, residual = rounded
            return linear.fp8.product_of_rounded(linear, q, s, linear.bias, residual.dtype), residual
    summed = x.single_part() if isinstance(x, DeferredSum) else x  # (an fp32 sum in one part: as it is)
    row = summed if residual is None else residual  # (16-bit, where summed may be fp32)
    if summed is not None and linear.streams(row) and not uses_tma(row, linear.weight):
        return normed_skinny_gemm(summed, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    if residual is None:
        return linear(norm(x)), x
    normed, residual = norm(x, residual)
    return linear(normed), residual
