import torch
from torch import nn

from batchgen.kernels import add_rmsnorm, rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: rmsnorm(x). With it: (rmsnorm(x + residual), x + residual)."""
        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        return add_rmsnorm(x, residual, self.weight, self.eps)
