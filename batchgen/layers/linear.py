"""Tensor-parallel linear layers. Each parameter carries a `weight_loader(param, loaded, shard)` that
copies its own slice of a checkpoint tensor, so the model loader stays a few lines.

ColumnParallelLinear: weight [out / tp, in]   (each rank computes a slice of the outputs)
RowParallelLinear:    weight [out, in / tp]   (each rank a partial sum; all-reduced)

An FP8 layer (layers/fp8.py) also holds weight_scale, fp32 [out rows] or its 128x128 block grid, and
for static activations input_scale (0-dim): each loader takes the rank's slice of those with the weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.kernels.rmsnorm import add_rmsnorm_fp8, add_rmsnorm_parts
from batchgen.layers.packed_linear import PackableWeight
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel


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

    def rows(self, shard: str | None) -> tuple[int, int, int]:
        """(first row in this rank's weight, rows, first row in the checkpoint's tensor) of a shard."""
        return 0, self.out_per_rank, self.tp.rank * self.out_per_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        offset, size, start = self.rows(shard)
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))

    def weight_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """FP8: a shard's scales, per row [rows] or [rows, 1], one per tensor (expanded to the shard's rows,
        so that merged shards each keep their own), or a block grid [ceil(rows / B), ceil(in / B)]."""
        offset, size, start = self.rows(shard)
        if param.dim() == 2:  # (block grid: the shard's rows start on a block; models/quantization.py checks)
            block = self.fp8.block
            rows = -(-(offset + size) // block) - offset // block
            _copy(param.data.narrow(0, offset // block, rows), loaded.narrow(0, start // block, rows))
        elif loaded.numel() == 1:
            param.data.narrow(0, offset, size).fill_(loaded.item())
        else:
            _copy(param.data.narrow(0, offset, size), loaded.reshape(-1).narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up): each rank holds its slice of each."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallel = SINGLE,
                 gate_up: bool = False):
        """gate_up: the two outputs are an MLP's gate and up, and the caller applies silu(gate) * up
        (the down projection's silu_mul): forward may return that instead of the pair (see matmul)."""
        self.out_sizes = out_sizes
        self.gate_up = gate_up
        super().__init__(in_features, sum(out_sizes), bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias, silu_mul_out=self.gate_up)

    def rows(self, shard: str | None) -> tuple[int, int, int]:
        index = int(shard)
        size = self.out_sizes[index] // self.tp.size
        return sum(self.out_sizes[:index]) // self.tp.size, size, self.tp.rank * size


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

    def rows(self, shard: str | None) -> tuple[int, int, int]:
        if shard == "q":
            return 0, self.q_size, self.tp.rank * self.q_size
        offset = self.q_size if shard == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, self.kv_head_start * self.head_dim


class RowParallelLinear(PackableWeight, nn.Module):
    defer_sum = False  # set by agree_on_deferred_sums once the model is built: can_defer_sum() of all its sums

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

    def weight_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """FP8: per row [out] or [out, 1], one per tensor (expanded to every row), or a block grid
        [ceil(out / B), ceil(in / B)] of which this rank takes its columns (its slice of in starts on a block)."""
        if param.dim() == 2:
            start = self.tp.rank * self.in_per_rank // self.fp8.block
            _copy(param, loaded.narrow(1, start, param.shape[1]))
        elif loaded.numel() == 1:
            param.data.fill_(loaded.item())
        else:
            _copy(param, loaded.reshape(-1))

    def can_defer_sum(self) -> bool:
        """Whether forward may hand its partial sums on unsummed: no bias to add after the sum, not the
        batch-invariant mode, and a product that writes where the all-reduce reads (an FP8 product makes a
        tensor of its own)."""
        return self.bias is None and self.fp8 is None and not self.batch_invariant

    def forward(
        self, x: torch.Tensor, silu_mul: bool = False, norm_follows: bool = False
    ) -> torch.Tensor | DeferredSum:
        """silu_mul: x is an MLP's gate/up output, the pair [T, 2 in] of which the product takes silu(gate)
        * up, or that already [T, in] (where the gate/up product applied it: MergedColumnParallelLinear).
        norm_follows: the caller's add + RMSNorm takes the output next, so it may get PartialSums,
        which that norm sums over the ranks in its own kernel (layers/layernorm.normed_product), or on
        one GPU SplitParts of a split-K product, which it sums the same way."""
        # The sum may come back as the symmetric buffer itself (parallel/symmetric_all_reduce.py): it is
        # valid until the next row-parallel product writes there, so it must be consumed before that
        # (as the add + RMSNorm after each of a layer's two products is); keep it past it only as a copy.
        out = (self.tp.reduce_buffer(x.shape[0], self.weight.shape[0], x.dtype, norm_follows and self.defer_sum)
               if x.dim() == 2 else None)
        parts_ok = norm_follows and self.bias is None and self.tp.size == 1
        y = self.matmul(x, silu_mul=silu_mul and x.shape[-1] == 2 * self.in_per_rank, out=out, parts_ok=parts_ok)
        if y.dim() == x.dim() + 1:  # split-K parts [S, T, out] (parts_ok): the norm after the product sums them
            return SplitParts(y)
        if norm_follows and self.defer_sum and self.tp.defers_sum(y):
            return PartialSums(y, self.tp)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def agree_on_deferred_sums(sums: list) -> None:
    """sums: every module of a model whose output an add + RMSNorm takes next (RowParallelLinear, the MoE
    block), each with can_defer_sum() and defer_sum. The fused all-reduce + add + RMSNorm leaves the residual
    right on its rank's own rows only, so once one norm of a forward takes partial sums every later one must:
    they defer all, or none."""
    every = all(module.can_defer_sum() for module in sums)
    for module in sums:
        module.defer_sum = every


class DeferredSum:
    """A row-parallel product's output still in parts, which the add + RMSNorm after it sums in its own
    kernel (see RowParallelLinear, layers/layernorm.py)."""

    def single_part(self) -> torch.Tensor | None:
        """The sum itself [T, out] (fp32) where it is in one part on this GPU, else None."""
        return None

    def add_rmsnorm(self, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum + residual) * weight, sum + residual)."""
        raise NotImplementedError

    def add_rmsnorm_fp8(self, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """add_rmsnorm's output rounded to e4m3 per row, (q, scales, sum + residual), where this form of the
        sum has that kernel (kernels/rmsnorm.add_rmsnorm_fp8); else None."""
        return None


@dataclass(frozen=True)
class PartialSums(DeferredSum):
    """This rank's partial sums before the sum over ranks (on the symmetric buffer)."""
    partials: torch.Tensor
    tp: TensorParallel

    def add_rmsnorm(self, residual, weight, eps):
        return self.tp.all_reduce_add_rmsnorm(self.partials, residual, weight, eps)


@dataclass(frozen=True)
class SplitParts(DeferredSum):
    """The fp32 parts [S, T, out] of a product whose K the tile kernel split (kernels/tile_gemm.py), or
    the one part of the one-row MLP's sum (layers/one_row_mlp.py)."""
    parts: torch.Tensor

    def single_part(self):
        return self.parts[0] if self.parts.shape[0] == 1 else None

    def add_rmsnorm(self, residual, weight, eps):
        assert residual is not None, "split-K parts are summed by an add + RMSNorm: it needs the residual"
        return add_rmsnorm_parts(self.parts, residual, weight, eps)

    def add_rmsnorm_fp8(self, residual, weight, eps):
        assert residual is not None, "split-K parts are summed by an add + RMSNorm: it needs the residual"
        return add_rmsnorm_fp8(self.parts[0], residual, weight, eps, self.parts)
