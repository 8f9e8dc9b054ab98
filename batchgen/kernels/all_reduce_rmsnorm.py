"""All-reduce + residual add + RMSNorm in one kernel, over symmetric memory (tensor parallelism).

After a row-parallel product each rank r of W holds partial sums P_r [M, H] in a buffer that every
rank has mapped (parallel/symmetric_all_reduce.py); every rank needs

    s = P_0 + ... + P_{W-1}           (rank order, fp32, rounded to the dtype: an all-reduce's sum)
    x = s + residual                  (rounded: the new residual)
    y = rmsnorm(x) * weight           (rounded as kernels/rmsnorm.py rounds)

Rank r computes rows [r ceil(M/W), (r+1) ceil(M/W)) only: x into its own residual (right on its own
rows only: the next call reads only those), y into every rank's output buffer. Two flag barriers a
program, before the reads and after the writes, make the buffers safe to reuse; the grid must be
co-resident (at most one program an SM), and the kernel is launched without PDL.
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
    mask = cols < hidden
    rows_per_rank = tl.cdiv(num_rows, WORLD)
    first = rank * rows_per_rank
    end = tl.minimum(num_rows, first + rows_per_rank)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _barrier(bases_ptr, flags_offset, rank, 0, WORLD, MAX_PROGRAMS)
    tl.debug_barrier()  # (every thread reads the peers' P after the wait)
    for row in range(first + tl.program_id(0), end, tl.num_programs(0)):
        at = row.to(tl.int64) * hidden + cols
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            acc += tl.load(_remote(bases_ptr, r, 0, dtype) + at, mask=mask, other=0.0).to(tl.float32)
        res = residual_ptr + row.to(tl.int64) * residual_stride + cols
        x = (acc.to(dtype).to(tl.float32) + tl.load(res, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        y = ((xf * rstd).to(dtype).to(tl.float32) * w).to(dtype)
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


def all_reduce_add_rmsnorm_ref(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y, x) for every row, as every rank should see them (rank order sum, rounded once)."""
    return add_rmsnorm_parts_ref(partials, residual, weight, eps)
