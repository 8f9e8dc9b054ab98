"""Batch-invariant products (EngineConfig.batch_invariant): y = x W^T (+ bias) where row i of y depends
on x[i] and W alone, never on how many rows share the launch.

Every output element sums K in one fixed order: BLOCK_K steps from k = 0 into one fp32 accumulator by
the tensor cores, then the bias. The row count only picks how rows and columns are grouped into tiles
(a tile's shape does not change a row's sum), so a decode row gives the same bits at 1 row as inside
a prefill step of 8,192. A split of K would change that order with the row count, so the split is
the weight's alone:

    parts[s] = x[:, Ks] W[:, Ks]^T   (fp32; s in [0, S), S = split_of(W) for every row count)

which the add + RMSNorm after the product sums in the order s = 0, 1, ... (rmsnorm.add_rmsnorm_parts).
Under the Triton interpreter (the CPU tests) the tile's products go through device.exact_dot instead of
tl.dot.
Products with few output columns (o, down) take S > 1 so that one decode row still spreads the weight
over the GPU; where no norm follows (qkv, gate/up, the LM head) S is 1. On the TMA path, past
PARTS_MAX_ROWS rows one program sums the S slices itself, each from zero and then in order, and hands
on that fp32 sum as a single part: the same bits, and the same norm kernel, without S parts' trips
through memory.

On Hopper (and datacenter Blackwell) the tiles are tile_gemm's, read through TMA, with gate/up's
SiLU-and-mul in the epilogue; elsewhere (and under the interpreter) this file's pointer kernel. Which
one runs depends on the weight alone, never on the row count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import exact_dot, interpreting, pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.skinny_gemm import tma_ok
from batchgen.kernels.tile_gemm import tile_gemm_supported, tile_gemm_triton

BLOCK_K = 64  # the one K step of every tile: the order each output element is summed in
MAX_SPLIT = 4
SPLIT_PROGRAMS = 128  # a split product aims at this many programs for one row (an H100/H200 has 132 SMs)
PARTS_MAX_ROWS = 64  # a split product of more rows sums its slices in the program (the module's docstring)


@triton.jit(do_not_specialize=["M"])  # (one compile per tile, not per row count)
def _invariant_gemm_kernel(
    x_ptr,  # [M, K]
    x_stride_m,
    w_ptr,  # [N, K]
    w_stride_n,
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N] in y's dtype, or [SPLIT, M, N] fp32 parts
    y_stride_m,
    M,
    N,
    K,
    K_PER_SPLIT,  # K, or with SPLIT > 1 a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32 rounding), else unused
    ROW_EXACT: tl.constexpr,  # the interpreter: products through device.exact_dot
    PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)  # (M tiles fastest: a W tile's second read, by the next M tile, hits the L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER_SPLIT
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_stride_m + (k_lo + ks)[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * w_stride_n + (k_lo + ks)[:, None]  # W^T's tile [BLOCK_K, BN]
    row_ok = (rows < M)[:, None]
    col_ok = (cols < N)[None, :]
    wait_for_prior_kernels(PDL)  # x is the kernel before's output
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in tl.range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K, num_stages=STAGES):
        k_ok = k + ks < K  # (past K: zeros, which add nothing)
        a = tl.load(x_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        w_t = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        if ROW_EXACT:
            acc += exact_dot(a, w_t)
        else:
            acc = tl.dot(a, w_t, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * y_stride_m + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok & col_ok)


def pick_tile(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) for m rows: narrow tiles for decode rows (more programs to stream W),
    the large tile for prefill steps. Every tile sums K in BLOCK_K steps, so the choice is free."""
    if m <= 64:
        return 64, 32, 4, 4
    if m <= 512:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def split_of(n: int, k: int) -> int:
    """The K split of a product with weight [n, k] whose caller sums parts: the fewest parts (<=
    MAX_SPLIT, each a whole number of BLOCK_K steps) that give one row's product SPLIT_PROGRAMS programs."""
    programs = triton.cdiv(n, pick_tile(1)[1])
    split = 1
    while split < MAX_SPLIT and programs * split < SPLIT_PROGRAMS and k % (2 * split * BLOCK_K) == 0:
        split *= 2
    return split


def tma_tile(m: int, silu_mul_out: bool, chunked: bool = False) -> tuple[int, int, int, int, int]:
    """tile_gemm's (BM, BN, BLOCK_K, stages, warps) for m rows on the TMA path (from an H200 sweep:
    benchmarks/KERNELS.md): deep pipelines for decode rows, large tiles for prefill steps (128 x 128
    where two accumulators live: gate/up, or K in chunks). Always BLOCK_K and at least 64 rows (the same
    tensor-core instruction for every tile)."""
    if m <= 16:
        return (64, 128, BLOCK_K, 4, 4) if silu_mul_out else (64, 128, BLOCK_K, 8, 4)
    if m <= 64:
        return 64, 64, BLOCK_K, 6, 4
    if silu_mul_out:
        return 128, 128, BLOCK_K, 4, 8
    if m <= 256:
        return 64, 128, BLOCK_K, 5, 4
    if m <= 4096 or chunked:
        return 128, 128, BLOCK_K, 5, 8
    return 256, 128, BLOCK_K, 3, 8


def takes_tma(weight: torch.Tensor) -> bool:
    """Whether products with this weight take tile_gemm's TMA kernel: 16-bit, TMA-aligned, whole BLOCK_K
    steps, on a GPU that has it. The weight alone decides."""
    return (weight.dtype in (torch.bfloat16, torch.float16) and weight.shape[1] % BLOCK_K == 0
            and weight.is_cuda and tile_gemm_supported(weight.device) and tma_ok(weight))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel takes the product: 16-bit or fp32 x and W of one dtype, rows contiguous."""
    return (x.dim() == 2 and x.dtype == weight.dtype and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def invariant_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split: int = 1,
    out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, silu_mul_out: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in out_dtype (default x's; into out when given), or
    with split > 1 the fp32 parts [split, M, N] (no bias) whose sum in order is the product (on the TMA
    path past PARTS_MAX_ROWS rows that sum as the one part [1, M, N]).
    silu_mul_out (weight = [Wg; Wu]): silu(x Wg^T) * (x Wu^T) [M, N / 2] where the TMA path runs, else
    the pair [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    assert supports(x, weight), "invariant_gemm: x and W of one dtype, rows contiguous"
    assert split == 1 or (k % (split * BLOCK_K) == 0 and bias is None)
    if m > 0 and takes_tma(weight):
        if not tma_ok(x):  # (a view of a wider buffer, or an unaligned one: the kernel reads a copy)
            x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
        silu_mul_out = silu_mul_out and bias is None and split == 1 and n % 2 == 0
        chunked = split > 1 and m > PARTS_MAX_ROWS
        shape = tma_tile(m, silu_mul_out, chunked)
        if chunked:  # (one part: the norm after it rounds and adds as it does the parts' sum, same warps)
            return tile_gemm_triton(x, weight, tile=(*shape, 1), chunks=split, out_dtype=torch.float32)[None]
        if split > 1:
            return tile_gemm_triton(x, weight, parts_ok=True, tile=(*shape, split))
        return tile_gemm_triton(x, weight, silu_mul_out, tile=(*shape, 1), out=out, bias=bias, out_dtype=out_dtype)
    if split > 1:
        y = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    elif out is not None:
        assert out.shape == (m, n) and out.stride(1) == 1 and out.dtype == (out_dtype or x.dtype)
        y = out
    else:
        y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, warps, stages = pick_tile(m)
    _invariant_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else weight, y, y.stride(-2),
        m, n, k, k // split, HAS_BIAS=bias is not None, BM=bm, BN=bn, BLOCK_K=BLOCK_K, STAGES=stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ROW_EXACT=interpreting(),
        num_warps=warps, num_stages=stages, **pdl_launch_args(x.device),
    )
    return y


def invariant_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The same product in fp32, rounded as the kernel rounds: [M, N] in out_dtype, or the fp32 parts
    [split, M, N] (each K slice's product)."""
    k = x.shape[1]
    xs, ws = x.float().split(k // split, dim=1), weight.float().split(k // split, dim=1)
    parts = torch.stack([xp @ wp.t() for xp, wp in zip(xs, ws)])
    if split > 1:
        return parts
    y = parts[0] if bias is None else parts[0] + bias.float()
    return y.to(out_dtype or x.dtype)


def invariant_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split: int = 1,
    out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, silu_mul_out: bool = False,
) -> torch.Tensor:
    """invariant_gemm_triton on a GPU; on CPU the reference (parts for split > 1, never SiLU-and-mul'd)."""
    if x.is_cuda:
        return invariant_gemm_triton(x, weight, bias, split, out_dtype, out, silu_mul_out)
    y = invariant_gemm_ref(x, weight, bias, split, out_dtype)
    return y if out is None or split > 1 else out.copy_(y)
