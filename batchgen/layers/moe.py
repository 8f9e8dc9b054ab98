"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router picks each token's top-k experts,
each a SiLU-gated MLP, and the token's output is their weighted sum.

  probs = softmax(x W_router^T) (fp32)  ->  top-k (renormalized to sum 1 where norm_topk_prob)
  out[t] = sum_k w[t,k] * (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down[e]^T,   e = topk_ids[t,k]
  (+ sigmoid(x W_sg^T) * shared_mlp(x) for Qwen2-MoE's shared expert)

Tensor parallel: the router is replicated (every rank picks the same experts); each expert's
intermediate dimension is split over the ranks (column slices of gate and up, row slice of down), so
each rank computes a partial sum of every token's output, which one all-reduce sums (as
RowParallelLinear's: where the add + RMSNorm after it sums it in its own kernel, the block hands on
PartialSums). The shared expert is split the same way and joins that one all-reduce. With expert
parallelism (--expert-parallel: TensorParallel.expert_parallel) each rank holds E / tp of the experts
whole instead, and sums only the pairs routed to them: the same all-reduce then sums the ranks' parts,
and each expert's products keep their whole width (a shard of I narrows the tiles as tp grows).
"""
from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.e4m3 import FP8
from batchgen.kernels.fused_moe import Fp8Experts, dequantize_experts, fused_moe, quantize_experts
from batchgen.kernels.moe_router import select_experts
from batchgen.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, PartialSums, RowParallelLinear
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel


class FusedExperts(nn.Module):
    """Every expert's gate/up and down as two stacked weights: w13 [E, 2 I / tp, H] (this rank's gate
    rows, then its up rows) and w2 [E, H, I / tp]; with expert parallelism this rank's E / tp experts
    whole, w13 [E / tp, 2I, H] and w2 [E / tp, H, I]. Loads one expert's gate_proj/up_proj/down_proj
    (Mixtral's w1/w3/w2), or transformers 5's fused gate_up_proj [E, 2I, H] / down_proj [E, H, I].
    FP8 experts (accept_fp8) keep e4m3 weights with scales on a GPU (kernels/fused_moe.Fp8Experts)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.routed_experts = num_experts  # the model's
        if tp.expert_parallel and tp.size > 1:
            self.num_experts = tp.split(num_experts, "--expert-parallel: the number of routed experts")  # this rank's
            self.first_expert, self.inter, self.inter_shards = tp.rank * self.num_experts, intermediate, 1
        else:
            self.num_experts, self.first_expert, self.inter_shards = num_experts, 0, tp.size
            self.inter = tp.split(intermediate, "expert intermediate features")  # per rank
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, self.inter), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.loaded: set[str] = set()  # the shards the loaders filled ("gate:3", and "gate:3:scale" for fp8)
        self.fp8: Fp8Experts | None = None
        self.quantize_at_load = False

    def accept_fp8(self, block: bool, quantize_at_load: bool = False) -> None:
        """FP8 experts, before loading: e4m3 weights with fp32 scales per output channel (a per-tensor
        checkpoint scale is spread over its rows) or per 128x128 block (block; each rank's slice of I must
        be whole blocks where tp > 1). quantize_at_load: the checkpoint's weights are 16/32-bit, quantized
        per channel after loading (--quantization fp8)."""
        self.quantize_at_load = quantize_at_load
        if quantize_at_load:
            self.fp8 = Fp8Experts(None, None, block=False)
            return
        num_experts, two_inter, hidden = self.w13.shape
        for name, shape in (("w13", (num_experts, two_inter, hidden)), ("w2", (num_experts, hidden, self.inter))):
            setattr(self, name, _param(torch.empty(shape, dtype=FP8, device=self.w13.device), self.weight_loader))
        w13_grid, w2_grid = Fp8Experts.scale_shapes(num_experts, hidden, self.inter, block)
        self.w13_scale = _param(torch.zeros(w13_grid, device=self.w13.device), self.scale_loader)
        self.w2_scale = _param(torch.zeros(w2_grid, device=self.w13.device), self.scale_loader)
        self.fp8 = Fp8Experts(self.w13_scale, self.w2_scale, block)

    def _rank_slice(self, loaded: torch.Tensor, dim: int, size: int | None = None) -> torch.Tensor:
        """This rank's slice of an expert's intermediate features (all of them with expert parallelism)."""
        if self.inter_shards == 1:
            return loaded
        size = size or self.inter
        return loaded.narrow(dim, self.tp.rank * size, size)

    def _local(self, expert: str) -> int | None:
        """The place among this rank's experts of the model's expert number `expert`; None: another rank's."""
        e = int(expert) - self.first_expert
        return e if 0 <= e < self.num_experts else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """shard: "gate:E", "up:E", "down:E" (one expert's [I, H], [I, H], [H, I]), or "gate_up" / "down"
        (all experts' [E, 2I, H] / [E, H, I])."""
        self.loaded.add(shard)
        part, _, expert = shard.partition(":")
        if not expert:  # (all experts: this rank's of them)
            loaded = loaded.narrow(0, self.first_expert, self.num_experts)
        elif (e := self._local(expert)) is None:
            return  # another rank's expert
        if part == "gate_up":
            full = loaded.shape[1] // 2
            gate, up = loaded.narrow(1, 0, full), loaded.narrow(1, full, full)
            _fill(param.data[:, :self.inter], self._rank_slice(gate, 1))
            _fill(param.data[:, self.inter:], self._rank_slice(up, 1))
        elif part == "down" and not expert:
            _fill(param.data, self._rank_slice(loaded, 2))
        elif part == "down":
            _fill(param.data[e], self._rank_slice(loaded, 1))
        else:
            offset = 0 if part == "gate" else self.inter
            _fill(param.data[e, offset:offset + self.inter], self._rank_slice(loaded, 0))

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """One expert's weight scale (shard "gate:E", "up:E" or "down:E"): per tensor (spread over the rows),
        per output channel ([N] or [N, 1]), or its 128x128 block grid; this rank's rows (or columns) of it."""
        self.loaded.add(f"{shard}:scale")
        part, _, expert = shard.partition(":")
        e = self._local(expert)
        if e is None:
            return  # another rank's expert
        loaded = loaded.float()
        rows = self.fp8.up_scale_row(self.inter)  # this rank's scale rows of gate or of up (channels, or blocks)
        if not self.fp8.block:  # ([N] or [N, 1], or one per tensor: every row's)
            loaded = loaded.reshape(-1).expand(param.shape[1] if part == "down" else rows * self.inter_shards)
        if part == "down":  # (its H rows whole on every rank; a block grid's columns run along I: this rank's)
            _fill(param.data[e], self._rank_slice(loaded, 1, rows) if self.fp8.block else loaded)
            return
        offset = 0 if part == "gate" else rows
        _fill(param.data[e, offset:offset + rows], self._rank_slice(loaded, 0, rows))

    def missing_weights(self) -> list[str]:
        """The experts' weights no checkpoint tensor filled: "gate:E", "up:E", "down:E" (an fp8 one: with
        its scale or its weight missing)."""
        scaled = self.fp8 is not None and not self.quantize_at_load
        gaps = []
        for e in range(self.routed_experts):
            for part in ("gate", "up", "down"):
                shard = f"{part}:{e}"
                weight = shard in self.loaded or ("down" if part == "down" else "gate_up") in self.loaded
                scale = f"{shard}:scale" in self.loaded
                if not weight and not scale:
                    gaps.append(shard)
                elif scaled and not (weight and scale):
                    gaps.append(f"{shard} ({'its scale' if weight else 'its e4m3 weight'} missing)")
        return gaps

    def finish_fp8(self, dtype: torch.dtype) -> None:
        """After loading FP8 experts: quantize_at_load quantizes each expert's rows; then on a CPU the
        weights are dequantized into dtype (the inputs are still rounded to e4m3 in forward), on a GPU the
        e4m3 weights and scales stay."""
        if self.quantize_at_load:
            w13, w2, self.fp8 = quantize_experts(self.w13.data, self.w2.data, block=False)
            self.w13, self.w2 = _param(w13), _param(w2)
            self.w13_scale, self.w2_scale = _param(self.fp8.w13_scale), _param(self.fp8.w2_scale)
        if self.w13.device.type == "cuda":
            return
        w13, w2 = dequantize_experts(self.w13.data, self.w2.data, self.fp8)
        self.w13, self.w2 = _param(w13.to(dtype)), _param(w2.to(dtype))
        self.w13_scale = self.w2_scale = None
        self.fp8 = Fp8Experts(None, None, self.fp8.block)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """-> this rank's partial sums [T, H] (in out where given)."""
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.fp8, out,  # (the torch reference on CPU)
                         self.first_expert, self.routed_experts)


def _param(tensor: torch.Tensor, loader=None) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    if loader is not None:
        param.weight_loader = loader
    return param


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

    defer_sum = False  # set by agree_on_deferred_sums once the model is built (as RowParallelLinear's)

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int = 0, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ColumnParallelLinear(hidden, num_experts, False, SINGLE)  # the router, whole on every rank
        self.gate.routes_tokens = True  # (--quantization fp8 leaves it in the model's dtype: models/fp8_layers.py)
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = SharedExpert(hidden, shared_intermediate, tp)
            self.shared_expert_gate = ColumnParallelLinear(hidden, 1, False, SINGLE)
            self.shared_expert_gate.routes_tokens = True

    def can_defer_sum(self) -> bool:
        """The experts' sum is written where the all-reduce reads it, in every form."""
        return True

    def forward(self, x: torch.Tensor, norm_follows: bool = False) -> torch.Tensor | PartialSums:
        """x [T, H] -> [T, H]. norm_follows: the caller's add + RMSNorm takes the output next, so it may get
        the ranks' PartialSums, which that norm sums in its own kernel (as RowParallelLinear hands them on)."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        # (the experts' sum over the k lands where the all-reduce reads it: the symmetric buffer, on GPUs
        # that have one; valid until the next row-parallel product writes there)
        staged = self.tp.reduce_buffer(x.shape[0], x.shape[1], x.dtype, norm_follows and self.defer_sum)
        out = self.experts(x, topk_weights, topk_ids, staged)
        if self.shared_expert is not None:  # (the gate is replicated: scaling each rank's part scales the sum)
            out.add_(torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial_sums(x))
        if norm_follows and self.defer_sum and self.tp.defers_sum(out):
            return PartialSums(out, self.tp)
        return self.tp.all_reduce(out)
