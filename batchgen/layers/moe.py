"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router picks each token's top-k experts,
each a SiLU-gated MLP, and the token's output is their weighted sum.

  probs = softmax(x W_router^T) (fp32)  ->  top-k (renormalized to sum 1 where norm_topk_prob)
  out[t] = sum_k w[t,k] * (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down[e]^T,   e = topk_ids[t,k]
  (+ sigmoid(x W_sg^T) * shared_mlp(x) for Qwen2-MoE's shared expert)

Tensor parallel: the router is replicated (every rank picks the same experts); each expert's
intermediate dimension is split over the ranks (column slices of gate and up, row slice of down), so
each rank computes a partial sum of every token's output, which one all-reduce sums (as
RowParallelLinear's). The shared expert is split the same way and joins that one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.e4m3 import FP8, dequantize_weight_ref
from batchgen.kernels.fused_moe import fused_moe, select_experts
from batchgen.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel


class FusedExperts(nn.Module):
    """Every expert's gate/up and down as two stacked weights: w13 [E, 2 I / tp, H] (this rank's gate
    rows, then its up rows) and w2 [E, H, I / tp]. Loads one expert's gate_proj/up_proj/down_proj
    (Mixtral's w1/w3/w2), or transformers 5's fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.inter = tp.split(intermediate, "expert intermediate features")  # per rank
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.num_experts = num_experts
        self.loaded: set[str] = set()  # the shards weight_loader filled (a checkpoint may lack an expert)
        self.pending: dict[str, dict[str, torch.Tensor]] | None = None  # (accept_fp8) shard -> weight / scale

    def accept_fp8(self) -> None:
        """An FP8 checkpoint's experts: each expert's e4m3 weight and its scale (per output channel, per
        tensor or per 128x128 block; shard "gate:E:scale" and so on) are dequantized into the model's dtype
        as both arrive, so the experts run in that dtype (the fused MoE has no fp8 form yet)."""
        self.pending = {}
        for param in (self.w13, self.w2):
            param.takes_fp8 = True  # (the loader hands these their checkpoint tensors as they are)

    def _rank_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        return loaded.narrow(dim, self.tp.rank * self.inter, self.inter)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """shard: "gate:E", "up:E", "down:E" (one expert's [I, H], [I, H], [H, I]), or "gate_up" / "down"
        (all experts' [E, 2I, H] / [E, H, I]); after accept_fp8 also an e4m3 weight and its scale
        (the shard with ":scale"), in either order."""
        if self.pending is not None and (shard.endswith(":scale") or loaded.dtype == FP8):
            shard, kind = shard.removesuffix(":scale"), "scale" if shard.endswith(":scale") else "weight"
            waiting = self.pending.setdefault(shard, {})
            waiting[kind] = loaded
            if len(waiting) < 2:
                return
            del self.pending[shard]
            loaded = dequantize_weight_ref(waiting["weight"], waiting["scale"])
        self.loaded.add(shard)
        part, _, expert = shard.partition(":")
        if part == "gate_up":
            full = loaded.shape[1] // 2
            gate, up = loaded.narrow(1, 0, full), loaded.narrow(1, full, full)
            _fill(param.data[:, :self.inter], self._rank_slice(gate, 1))
            _fill(param.data[:, self.inter:], self._rank_slice(up, 1))
        elif part == "down" and not expert:
            _fill(param.data, self._rank_slice(loaded, 2))
        elif part == "down":
            _fill(param.data[int(expert)], self._rank_slice(loaded, 1))
        else:
            offset = 0 if part == "gate" else self.inter
            _fill(param.data[int(expert), offset:offset + self.inter], self._rank_slice(loaded, 0))

    def missing_weights(self) -> list[str]:
        """The experts' weights no checkpoint tensor filled: "gate:E", "up:E", "down:E" (an fp8 one: with
        its scale or its weight missing)."""
        halves = [f"{shard} ({'its scale' if 'weight' in got else 'its e4m3 weight'} missing)"
                  for shard, got in (self.pending or {}).items()]
        return halves + [f"{part}:{e}" for e in range(self.num_experts) for part in ("gate", "up", "down")
                         if f"{part}:{e}" not in self.loaded
                         and ("down" if part == "down" else "gate_up") not in self.loaded
                         and f"{part}:{e}" not in (self.pending or {})]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """-> this rank's partial sums [T, H]."""
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)  # (the torch reference on CPU)


def _fill(target: torch.Tensor, loaded: torch.Tensor) -> None:
    assert target.shape == loaded.shape, f"shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
    target.copy_(loaded)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: an MLP every token takes, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], False, tp, gate_up=True)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp)

    def partial_sums(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the MLP's output [T, H] (not yet summed over ranks)."""
        gate_up = self.gate_up_proj(x)  # the pair [T, 2 I], or silu(gate) * up [T, I] where the tile kernel ran
        return self.down_proj.matmul(gate_up, silu_mul=gate_up.shape[-1] == 2 * self.down_proj.in_per_rank)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer; forward takes the normed hidden states and returns the summed output."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int = 0, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ColumnParallelLinear(hidden, num_experts, False, SINGLE)  # the router, whole on every rank
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = SharedExpert(hidden, shared_intermediate, tp)
            self.shared_expert_gate = ColumnParallelLinear(hidden, 1, False, SINGLE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:  # (the gate is replicated: scaling each rank's part scales the sum)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial_sums(x)
        return self.tp.all_reduce(out)
