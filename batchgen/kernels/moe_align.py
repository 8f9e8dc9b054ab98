"""The (token, choice) pairs of a MoE layer grouped by expert in blocks of BLOCK_M slots, for the
grouped products of kernels/fused_moe.py. Pair p = t * k + j is token t's j-th expert choice.

    counts[e]      = pairs routed to expert e
    padded[e]      = counts[e] rounded up to a multiple of BLOCK_M
    starts[e]      = padded[0] + ... + padded[e - 1]
    sorted_ids     [max_slots] int32: expert e's pairs (ascending p) at slots starts[e] .. starts[e] + counts[e],
                   num_pairs (= T * k, a sentinel) in its padding
    block_expert   [max_blocks] int32: the expert of each BLOCK_M slots, -1 past the padded total
    num_padded     [1] int32: sum(padded), the slots in use

Experts e are local: a rank that holds experts first_expert .. first_expert + E - 1 of the model's
(expert parallelism: layers/moe.py) groups the pairs routed to those, as e = id - first_expert, and
leaves every other pair out (no slot: another rank computes it).

Every buffer has the worst case's size (max_slots: num_pairs + min(num_pairs, E) * (BLOCK_M - 1), as
only experts with pairs are padded) and nothing is read back to the host, so a CUDA graph captures
the step: the products' grids cover max_blocks and blocks past num_padded exit at once.

Up to TRITON_MAX_PAIRS pairs (decode steps, small prefill chunks) two Triton launches over chunks of
pairs do it (counts per chunk, then each chunk's pairs placed; no atomics); above that a few sync-free
torch ops (a stable sort, a scatter_add_ count, cumsums) do, where their launches are small beside the
products. Both give the same buffers up to num_padded (past it the Triton kernels write nothing: nothing
reads it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels

# The kernels' chunk scans grow with the pairs, the torch ops' cost hardly does: past ~3,000 tokens at top-8
# the torch ops win (the crossover measured in benchmarks/KERNELS.md).
TRITON_MAX_PAIRS = 24576
ONE_HOT_ELEMENTS = 8192  # [CHUNK, BLOCK_E] one-hot tile of a program's pairs: CHUNK = this / BLOCK_E


def max_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most slots the padded grouping can take, rounded up to whole blocks."""
    worst = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _chunk_one_hot(ids_ptr, chunk, num_pairs, first_expert, num_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The chunk's pairs [CHUNK], whether each is one of this rank's, and their local experts one-hot
    [CHUNK, BLOCK_E] (a row of zeros for a pair of another rank's expert)."""
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) - first_expert
    one_hot = (ids[:, None] == experts[None, :]) & (experts < num_experts)[None, :]
    ok = (pairs < num_pairs) & (ids >= 0) & (ids < num_experts)
    return pairs, ok, one_hot.to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs", "first_expert"])
def _count_kernel(
    ids_ptr,  # [num_pairs] int32: expert of pair p (topk_ids flattened)
    counts_ptr,  # [num_chunks, BLOCK_E] int32 out: each chunk's pairs an expert
    num_pairs,
    first_expert,  # this rank's first expert (0 unless experts are split over ranks)
    num_experts,  # this rank's experts
    CHUNK: tl.constexpr,  # pairs a program
    BLOCK_E: tl.constexpr,  # experts rounded up to a power of two
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    chunk = tl.program_id(0)
    wait_for_prior_kernels(PDL)  # the router's top-k wrote ids
    _, _, one_hot = _chunk_one_hot(ids_ptr, chunk, num_pairs, first_expert, num_experts, CHUNK, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(one_hot, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "first_expert", "num_chunks", "max_blocks"])
def _place_kernel(
    ids_ptr,  # [num_pairs] int32
    counts_ptr,  # [num_chunks, BLOCK_E] int32 (_count_kernel)
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    num_pairs,
    first_expert,
    num_experts,
    num_chunks,
    max_blocks,
    BLOCK_M: tl.constexpr,  # slots a block
    CHUNK: tl.constexpr,  # pairs a program
    BLOCK_E: tl.constexpr,  # experts rounded up to a power of two
    ROWS: tl.constexpr,  # chunks' counts summed a step
    BLOCK_B: tl.constexpr,  # blocks a step of a program's block_expert loop
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    chunk = tl.program_id(0)
    wait_for_prior_kernels(PDL)  # the counts
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)  # all chunks'
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # chunks before this one's
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        part = tl.load(counts_ptr + rows[:, None] * BLOCK_E + experts[None, :], mask=(rows < num_chunks)[:, None],
                       other=0)
        counts += tl.sum(part, axis=0)
        before += tl.sum(tl.where((rows < chunk)[:, None], part, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # a pair's slot: its expert's start + the expert's pairs before it (earlier chunks, then this one)
    pairs, ok, one_hot = _chunk_one_hot(ids_ptr, chunk, num_pairs, first_expert, num_experts, CHUNK, BLOCK_E)
    earlier = tl.cumsum(one_hot, axis=0) - one_hot  # [CHUNK, BLOCK_E]
    slot = tl.sum(one_hot * (earlier + (starts + before)[None, :]), axis=1)
    tl.store(sorted_ids_ptr + slot, pairs, mask=ok)
    total = tl.sum(padded, axis=0)
    if chunk == 0:
        tl.store(num_padded_ptr, total)
    # the padding of this program's experts (e = chunk, chunk + num_chunks, ...), [BLOCK_E, BLOCK_M] slots (at
    # most BLOCK_M - 1 an expert), gets the sentinel: spread over the programs, no one of them does it all
    mine = (experts % num_chunks) == chunk
    pad_slots = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + pad_slots, tl.zeros(pad_slots.shape, tl.int32) + num_pairs,
             mask=(pad_slots < ends[:, None]) & mine[:, None])
    # this program's share of the blocks' expert: the number of experts whose slots end at or before the
    # block's first slot (experts past num_experts have no slots: they end at total, past every block in use)
    per = tl.cdiv(max_blocks, num_chunks)
    share_end = tl.minimum(chunk * per + per, max_blocks)
    for b0 in range(chunk * per, share_end, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, expert, -1), mask=blocks < share_end)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     first_expert: int = 0) -> tuple[torch.Tensor, ...]:
    """topk_ids [T, k] -> (sorted_ids, block_expert, num_padded) in two launches over chunks of pairs:
    each chunk's expert counts, then every program sums the counts (all chunks', and those before
    its own), places its chunk's pairs, and writes its share of the experts' padding and the blocks' experts."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    num_pairs = ids.numel()
    slots = max_slots(num_pairs, num_experts, block_m)
    max_blocks = slots // block_m
    device = ids.device
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(16, ONE_HOT_ELEMENTS // block_e)
    num_chunks = max(1, triton.cdiv(num_pairs, chunk))
    counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
    warps = 8 if block_e >= 128 else 4
    _count_kernel[(num_chunks,)](ids, counts, num_pairs, first_expert, num_experts, CHUNK=chunk, BLOCK_E=block_e,
                                 num_warps=warps, **pdl_launch_args(device))
    _place_kernel[(num_chunks,)](
        ids, counts, sorted_ids, block_expert, num_padded, num_pairs, first_expert, num_experts, num_chunks,
        max_blocks,
        BLOCK_M=block_m, CHUNK=chunk, BLOCK_E=block_e, ROWS=max(1, min(32, ONE_HOT_ELEMENTS // block_e)),
        BLOCK_B=min(chunk, triton.next_power_of_2(triton.cdiv(max_blocks, num_chunks))), num_warps=warps,
        **pdl_launch_args(device),
    )
    return sorted_ids, block_expert, num_padded


def local_expert_ids(topk_ids: torch.Tensor, first_expert: int, num_experts: int) -> torch.Tensor:
    """Each pair's expert among this rank's, flat [T*k] int64: id - first_expert, and num_experts (one past
    them) for a pair routed to another rank's expert."""
    ids = topk_ids.reshape(-1).long() - first_expert
    return torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    first_expert: int = 0) -> tuple[torch.Tensor, ...]:
    """The same buffers from sync-free torch ops (a scatter_add_ count: torch.bincount is not
    graph-safe on CUDA in every version). Other ranks' pairs count as one more expert, placed after
    this rank's, whose slots are then dropped (the one past the buffer takes their writes)."""
    ids = local_expert_ids(topk_ids, first_expert, num_experts)
    num_pairs = ids.numel()
    device = ids.device
    slots = max_slots(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    first_pair_rank = counts.cumsum(0) - counts  # an expert's first pair's place in expert order
    order = torch.sort(ids, stable=True).indices  # pairs by expert, ascending within one
    expert = ids[order]
    slot = starts[expert] + torch.arange(num_pairs, device=device) - first_pair_rank[expert]
    slot = torch.where(expert < num_experts, slot, slots)
    sorted_ids = torch.full((slots + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, slot, order.to(torch.int32))
    first = torch.arange(0, slots, block_m, device=device)
    total = ends[num_experts - 1:num_experts]
    block_expert = torch.where(first < total, torch.searchsorted(ends[:num_experts], first, right=True), -1)
    return sorted_ids[:slots], block_expert.to(torch.int32), total.to(torch.int32)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              first_expert: int = 0) -> tuple[torch.Tensor, ...]:
    """(sorted_ids, block_expert, num_padded) of the module's docstring: the Triton kernels for up to
    TRITON_MAX_PAIRS pairs on a GPU, torch ops otherwise."""
    if topk_ids.is_cuda and topk_ids.numel() <= TRITON_MAX_PAIRS:
        return moe_align_triton(topk_ids, num_experts, block_m, first_expert)
    return moe_align_torch(topk_ids, num_experts, block_m, first_expert)
