"""Tensor-parallel linear layers. Each parameter carries a `weight_loader(param, loaded, shard)` that
copies its own slice of a checkpoint tensor, so the model loader stays a few lines.

ColumnParallelLinear: weight [out / tp, in]   (each rank computes a slice of the outputs)
RowParallelLinear:    weight [out, in / tp]   (each rank a partial sum; all-reduced)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.forward.parallel import SINGLE, TensorParallel
from batchgen.layers.packed_linear import PackableWeight


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
    param.data.copy_(loaded)


class ColumnParallelLinear(PackableWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.out_per_rank = tp.split(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        _copy(param, loaded.narrow(0, self.tp.rank * self.out_per_rank, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up): each rank holds its slice of each."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallel = SINGLE):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        index = int(shard)
        size = self.out_sizes[index] // self.tp.size
        offset = sum(self.out_sizes[:index]) // self.tp.size
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix: rows [q heads | k heads | v heads] of this rank.
    KV heads are split across ranks, or replicated when there are fewer KV heads than ranks."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
        tp: TensorParallel = SINGLE,
    ):
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(num_kv_heads, "KV heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:  # replicate: ranks that share a KV head hold the same copy
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of the {num_kv_heads} KV heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        total = (num_heads + 2 * self.num_kv_heads * tp.size) * head_dim
        super().__init__(hidden, total, bias, tp)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            offset = self.q_size if shard == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(PackableWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.split(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda param, loaded, shard=None: _copy(param, loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        _copy(param, loaded.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank))

    def forward(
        self, x: torch.Tensor, silu_mul: bool = False, norm_follows: bool = False
    ) -> torch.Tensor | PartialSums:
        """silu_mul: x is a gate/up pair, the product takes silu(gate) * up (an MLP's down projection).
        norm_follows: the caller's add + RMSNorm takes the output next, so it may get PartialSums,
        which that norm sums over the ranks in its own kernel (layers/layernorm.normed_product)."""
        # The sum may come back as the symmetric buffer itself (forward/symmetric_all_reduce.py): it is
        # valid until the next row-parallel product writes there, so it must be consumed before that
        # (as the add + RMSNorm after each of a layer's two products is); keep it past it only as a copy.
        out = self.tp.reduce_buffer(x.shape[0], self.weight.shape[0], x.dtype) if x.dim() == 2 else None
        y = self.matmul(x, silu_mul=silu_mul, out=out)
        if norm_follows and self.bias is None and self.tp.defers_sum(y):
            return PartialSums(y, self.tp)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class PartialSums:
    """A row-parallel product's output on this rank before the sum over ranks (see RowParallelLinear);
    the RMSNorm after it sums them (layers/layernorm.py)."""
    partials: torch.Tensor
    tp: TensorParallel
