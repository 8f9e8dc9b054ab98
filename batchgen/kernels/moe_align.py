"""The (token, choice) pairs of a MoE layer grouped by expert in blocks of BLOCK_M slots, for the
grouped products of kernels/fused_moe.py. Pair p = t * k + j is token t's j-th expert choice.

    counts[e]      = pairs routed to expert e
    padded[e]      = counts[e] rounded up to a multiple of BLOCK_M
    starts[e]      = padded[0] + ... + padded[e - 1]
    sorted_ids     [max_slots] int32: expert e's pairs (ascending p) at slots starts[e] .. starts[e] + counts[e],
                   num_pairs (= T * k, a sentinel) in its padding
    block_expert   [max_blocks] int32: the expert of each BLOCK_M slots, -1 past the padded total
    num_padded     [1] int32: sum(padded), the slots in use

Every buffer has the worst case's size (max_slots: num_pairs + min(num_pairs, E) * (BLOCK_M - 1), as
only experts with pairs are padded) and nothing is read back to the host, so a CUDA graph captures
the step: the products' grids cover max_blocks and blocks past num_padded exit at once.

Up to ONE_PROGRAM_MAX_PAIRS pairs (decode) one Triton program does it all in one launch; above that
a few sync-free torch ops (a stable sort, a scatter_add_ count, cumsums) do, where their launches are
small beside the products. Both give the same buffers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels

ONE_PROGRAM_MAX_PAIRS = 8192
ONE_HOT_ELEMENTS = 8192  # [CHUNK, BLOCK_E] one-hot tile of a chunk of pairs: CHUNK = this / BLOCK_E


def max_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most slots the padded grouping can take, rounded up to whole blocks."""
    worst = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_align_kernel(
    ids_ptr,  # [num_pairs] int32: expert of pair p (topk_ids flattened)
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,  # slots a block
    BLOCK_E: tl.constexpr,  # num_experts rounded up to a power of two
    CHUNK: tl.constexpr,  # pairs a step
    BLOCK_B: tl.constexpr,  # blocks a step of the block_expert loop
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)  # the router's top-k wrote ids
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        pairs = c0 + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # each expert's padding, [BLOCK_E, BLOCK_M] slots (at most BLOCK_M - 1 an expert), gets the sentinel
    pad_slots = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + pad_slots, tl.full(pad_slots.shape, 0, tl.int32) + num_pairs,
             mask=pad_slots < ends[:, None])
    # a block's expert: the number of experts whose slots end at or before the block's first slot
    # (experts past num_experts have no slots: they end at total, past every block in use)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, expert, -1), mask=blocks < max_blocks)
    # a pair's slot: its expert's start + the expert's pairs before it (earlier chunks, then this one)
    filled = starts
    for c0 in range(0, num_pairs, CHUNK):
        pairs = c0 + lanes
        ok = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=ok, other=-1)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.cumsum(one_hot, axis=0) - one_hot  # earlier pairs of the same expert in the chunk
        slot = tl.sum(one_hot * (before + filled[None, :]), axis=1)
        tl.store(sorted_ids_ptr + slot, pairs, mask=ok)
        filled += tl.sum(one_hot, axis=0)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """topk_ids [T, k] -> (sorted_ids, block_expert, num_padded) in one program (the module's docstring)."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    num_pairs = ids.numel()
    slots = max_slots(num_pairs, num_experts, block_m)
    max_blocks = slots // block_m
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        ids, sorted_ids, block_expert, num_padded, num_pairs, num_experts, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, ONE_HOT_ELEMENTS // block_e),
        BLOCK_B=max(16, ONE_HOT_ELEMENTS // block_e), num_warps=8 if block_e >= 128 else 4,
        **pdl_launch_args(ids.device),
    )
    return sorted_ids, block_expert, num_padded


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The same buffers from sync-free torch ops (a scatter_add_ count: torch.bincount is not
    graph-safe on CUDA in every version)."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    device = ids.device
    slots = max_slots(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    first_pair_rank = counts.cumsum(0) - counts  # an expert's first pair's place in expert order
    order = torch.sort(ids, stable=True).indices  # pairs by expert, ascending within one
    expert = ids[order]
    slot = starts[expert] + torch.arange(num_pairs, device=device) - first_pair_rank[expert]
    sorted_ids = torch.full((slots,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, slot, order.to(torch.int32))
    first = torch.arange(0, slots, block_m, device=device)
    total = ends[-1:]
    block_expert = torch.where(first < total, torch.searchsorted(ends, first, right=True), -1)
    return sorted_ids, block_expert.to(torch.int32), total.to(torch.int32)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(sorted_ids, block_expert, num_padded) of the module's docstring: one Triton program for up to
    ONE_PROGRAM_MAX_PAIRS pairs on a GPU, torch ops otherwise."""
    if topk_ids.is_cuda and topk_ids.numel() <= ONE_PROGRAM_MAX_PAIRS:
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)
