"""RMSNorm, alone and fused with the residual add.

    y = x / sqrt(mean(x^2) + eps) * weight          (statistics in fp32, as HF Llama computes them)
    add_rmsnorm: r' = x + r (in x's dtype);  y = rmsnorm(r')
"""
import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> [T, H]."""
    return rmsnorm_ref(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rmsnorm(x + residual), x + residual)."""
    return add_rmsnorm_ref(x, residual, weight, eps)
