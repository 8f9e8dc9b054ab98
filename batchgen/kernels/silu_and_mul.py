"""SiLU-and-mul on the fused gate/up projection:  y = silu(x[:, :I]) * x[:, I:]."""
import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] -> [T, I]."""
    return silu_and_mul_ref(x)
