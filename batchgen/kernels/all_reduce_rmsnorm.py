"""All-reduce + residual add + RMSNorm in one kernel, over symmetric memory (tensor parallelism).

After a row-parallel product each rank r of W holds partial sums P_r [M, H] in a buffer that every
rank has mapped (parallel/symmetric_all_reduce.py); every rank needs

    s = P_0 + ... + P_{W-1}           (rank order, fp32, rounded to the dtype: an all-reduce's sum)
    x = s + residual                  (rounded: the new residual)
    y = rmsnorm(x) * weight           (rounded as kernels/rmsnorm.py rounds)

Two forms (the grid co-resident, at most one program an SM; launched without PDL):
- two-shot: rank r computes rows [r ceil(M/W), (r+1) ceil(M/W)) only: x into its own residual (right on
  its own rows only: the next call reads only those), y into every rank's output buffer. Flag barriers
  before the reads and after the remote writes make the buffers safe to reuse.
- one-shot (small M): every rank reads all W partial sums and computes every row itself, x and y
  locally: no remote writes, so one barrier, before the reads. The caller must not rewrite the partial
  sums' buffer until every peer has read it: it alternates two buffers, and the next call's barrier
  proves the peers are done with the last but one (parallel/symmetric_all_reduce.py).
Both give every row's y bit for bit the same.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.rmsnorm import add_rmsnorm_parts_ref


@triton.jit
def _remote(bases_ptr, rank, byte_offset, DTYPE: tl.constexpr):
    """A pointer of DTYPE at byte_offset into rank's mapping of the symmetric allocation."""
    base = tl.load(bases_ptr + rank)
    return (base + byte_offset).to(tl.pointer_type(DTYPE))


@triton.jit
def _barrier(bases_ptr, flags_offset, rank, slot, WORLD: tl.constexpr, MAX_PROGRAMS: tl.constexpr):
    """Program p of this rank meets program p of every other rank. Flag (slot, p, sender) lives in the
    receiver's memory."""
    pid = tl.program_id(0)
    mine = (slot * MAX_PROGRAMS + pid) * WORLD
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = _remote(bases_ptr, peer, flags_offset, tl.int32) + mine + rank
            tl.atomic_xchg(flag, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = _remote(bases_ptr, rank, flags_offset, tl.int32) + mine + peer
            while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@triton.jit
def _epoch_barrier(bases_ptr, flags_offset, counters_ptr, rank, WORLD: tl.constexpr):
    """Program p meets program p of every other rank without resetting flags: each sends the count of
    its calls so far (its own counters_ptr[p] + 1) and waits until every peer's has reached it. A peer
    is at most one call ahead, so the wrapping int32 difference orders them even past 2^31 calls."""
    pid = tl.program_id(0)
    epoch = tl.load(counters_ptr + pid) + 1
    tl.store(counters_ptr + pid, epoch)
    mine = pid * WORLD
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = _remote(bases_ptr, peer, flags_offset, tl.int32) + mine + rank
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = _remote(bases_ptr, rank, flags_offset, tl.int32) + mine + peer
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") - epoch < 0:
                pass


@triton.jit
def _sum_add_rmsnorm_row(bases_ptr, partials_offset, residual_ptr, residual_stride, w, row, hidden, eps,
                         WORLD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row `row`: s = the ranks' partial sums (rank order, fp32, rounded once), x = s + residual (stored
    as the new residual), -> (y = rmsnorm(x) * w, its offsets, its mask)."""
    dtype = residual_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    at = row.to(tl.int64) * hidden + cols
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        acc += tl.load(_remote(bases_ptr, r, partials_offset, dtype) + at, mask=mask, other=0.0).to(tl.float32)
    res = residual_ptr + row.to(tl.int64) * residual_stride + cols
    x = (acc.to(dtype).to(tl.float32) + tl.load(res, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(res, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    return ((xf * rstd).to(dtype).to(tl.float32) * w).to(dtype), at, mask


@triton.jit(do_not_specialize=["eps", "num_rows", "rank"])
def _all_reduce_add_rmsnorm_kernel(
    bases_ptr,  # [W] int64: each rank's address of the symmetric allocation
    residual_ptr,  # [M, H] this rank's residual: read and written on this rank's rows
    residual_stride,
    weight_ptr,  # [H]
    num_rows,  # M
    hidden,  # H
    eps,
    rank,
    out_offset,  # bytes from an allocation's start to its [M, H] output region (P starts at 0)
    flags_offset,  # bytes to its int32 flags, [2, MAX_PROGRAMS, W]
    WORLD: tl.constexpr,
    MAX_PROGRAMS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of 2 >= H: a program holds a whole row
):
    dtype = residual_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    rows_per_rank = tl.cdiv(num_rows, WORLD)
    first = rank * rows_per_rank
    end = tl.minimum(num_rows, first + rows_per_rank)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    _barrier(bases_ptr, flags_offset, rank, 0, WORLD, MAX_PROGRAMS)
    tl.debug_barrier()  # (every thread reads the peers' P after the wait)
    for row in range(first + tl.program_id(0), end, tl.num_programs(0)):
        y, at, mask = _sum_add_rmsnorm_row(bases_ptr, 0, residual_ptr, residual_stride, w, row, hidden, eps,
                                           WORLD, BLOCK_H)
        for r in tl.static_range(WORLD):
            tl.store(_remote(bases_ptr, r, out_offset, dtype) + at, y, mask=mask)
    tl.debug_barrier()  # (every thread's stores are issued before the release)
    _barrier(bases_ptr, flags_offset, rank, 1, WORLD, MAX_PROGRAMS)


def all_reduce_add_rmsnorm_triton(
    bases: torch.Tensor, rank: int, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out_offset: int, flags_offset: int, max_programs: int,
) -> None:
    """Every rank's [M, H] partial sums lie at the start of its allocation (bases: [W] int64 on the
    device, each rank's address of it), the output region at out_offset bytes and the flags at
    flags_offset; residual: [M, H] on this rank, updated on this rank's rows. Every rank calls it
    with the same M, and afterwards every rank's output region holds all M rows of y."""
    num_rows, hidden = residual.shape
    assert residual.stride(1) == 1 and residual.dtype == weight.dtype and weight.is_contiguous()
    assert out_offset % 16 == 0 and flags_offset % 4 == 0 and bases.dtype == torch.int64
    block_h = triton.next_power_of_2(hidden)
    world = bases.numel()
    programs = max(1, min(triton.cdiv(num_rows, world), max_programs))
    _all_reduce_add_rmsnorm_kernel[(programs,)](
        bases, residual, residual.stride(0), weight, num_rows, hidden, eps, rank, out_offset, flags_offset,
        WORLD=world, MAX_PROGRAMS=max_programs, BLOCK_H=block_h, num_warps=min(max(block_h // 512, 1), 16),
    )


@triton.jit(do_not_specialize=["eps", "num_rows", "rank", "partials_offset"])
def _one_shot_kernel(
    bases_ptr,  # [W] int64
    residual_ptr,  # [M, H] this rank's residual: every row read and written
    residual_stride,
    weight_ptr,  # [H]
    out_ptr,  # [M, H] y, on this rank
    num_rows,
    hidden,
    eps,
    rank,
    partials_offset,  # bytes from an allocation's start to the ranks' [M, H] partial sums
    flags_offset,  # bytes to its int32 epoch flags, [MAX_PROGRAMS, W]
    counters_ptr,  # [MAX_PROGRAMS] int32 on this rank: the calls each program has made
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_H)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    _epoch_barrier(bases_ptr, flags_offset, counters_ptr, rank, WORLD)
    tl.debug_barrier()  # (every thread reads the peers' P after the wait)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        y, at, mask = _sum_add_rmsnorm_row(bases_ptr, partials_offset, residual_ptr, residual_stride, w, row, hidden,
                                           eps, WORLD, BLOCK_H)
        tl.store(out_ptr + at, y, mask=mask)


def all_reduce_add_rmsnorm_one_shot_triton(
    bases: torch.Tensor, rank: int, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
    partials_offset: int, flags_offset: int, counters: torch.Tensor,
) -> None:
    """The one-shot form: every rank's [M, H] partial sums at partials_offset bytes into its allocation;
    every row of y into out [M, H] and of the new residual into residual, on this rank. counters: [P]
    int32, zeroed with the flags, then kept for every call (P = counters.numel(), the most programs)."""
    num_rows, hidden = residual.shape
    assert residual.stride(1) == 1 and residual.dtype == weight.dtype == out.dtype and weight.is_contiguous()
    assert out.is_contiguous() and partials_offset % 16 == 0 and flags_offset % 4 == 0
    block_h = triton.next_power_of_2(hidden)
    _one_shot_kernel[(max(1, min(num_rows, counters.numel())),)](
        bases, residual, residual.stride(0), weight, out, num_rows, hidden, eps, rank, partials_offset, flags_offset,
        counters, WORLD=bases.numel(), BLOCK_H=block_h, num_warps=min(max(block_h // 512, 1), 16),
    )


def all_reduce_add_rmsnorm_ref(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y, x) for every row, as every rank should see them (rank order sum, rounded once)."""
    return add_rmsnorm_parts_ref(partials, residual, weight, eps)
