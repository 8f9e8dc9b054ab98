"""FP8 (e4m3) products: y = x @ W^T with x [T, K] in 16 bits and W [N, K] in float8_e4m3fn with its scales.

Activations are rounded to e4m3 before the product, with one scale per token (dynamic), per group of
128 columns (the block form), or the checkpoint's static scale:

    s[t] = max(amax_k |x[t, k]|, MIN_AMAX) / 448      q[t, k] = e4m3(x[t, k] / s[t])
    y[t, n] = sum_k q[t, k] * W[n, k] * s[t] * ws[n]                    (per-channel weight scale ws)
    y[t, n] = sum_g s[t, g] * ws[n // 128, g] * sum_{k in g} q[t, k] * W[n, k]    (128x128 blocks)

Up to 256 rows, per-channel weights take Triton tiles: on Hopper tile_gemm's TMA kernel with the scales in
its epilogue (o and down in split-K parts that the norm after them sums; tma_tile), else a pointer-based
kernel; past that (and for an 8B-sized gate/up at 65-128 rows) cuBLAS's row-wise scaled product
(torch._scaled_mm). The block form takes cuBLAS's blockwise product past a few rows (1x128 activation
groups, 128x128 weight blocks: sm_90 with CUDA >= 12.9); below, and where cuBLAS cannot, the pointer kernel
applies each 128-column block's scales to its partial sum. The
quantizing kernel may take an MLP's gate/up pair and round silu(gate) * up instead (the down projection's
input); per-token rows that an add + RMSNorm makes come rounded by it (kernels/rmsnorm.add_rmsnorm_fp8),
and fp8_product takes them. Group scales are stored M-major ([T, groups] with stride (1, T)), the layout cuBLAS reads.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import num_sms
from batchgen.kernels.e4m3 import FP8, FP8_MAX, GROUP, MIN_AMAX, dequantize_weight_ref, round_ref
from batchgen.kernels.skinny_gemm import tma_ok
from batchgen.kernels.tile_gemm import Tile, tile_gemm_supported, tile_gemm_triton

WIDE_N = 16384  # an MLP's gate/up, from the 1B shape up


# ---- torch reference -----------------------------------------------------------------------------

def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, silu_mul: bool = False) -> torch.Tensor:
    """The definition, in fp32: activations rounded as quantize_ref rounds them, weights dequantized."""
    block = weight_scale.dim() == 2
    xd = round_ref(x, input_scale, GROUP if block and input_scale is None else None, silu_mul)
    y = xd @ dequantize_weight_ref(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# ---- Triton -------------------------------------------------------------------------------------

@triton.jit
def _row_values(x_ptr, offs, mask, K, SILU_MUL: tl.constexpr):
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        x = x * tl.sigmoid(x) * up
    return x


@triton.jit
def _quantize_row_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, K, x_stride, q_stride, s_stride,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, STATIC: tl.constexpr, SILU_MUL: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    """One program per row, one scale for it (dynamic or static). ONE_PASS (K <= BLOCK): the row is loaded
    once and held, every load in flight at once; else it is read twice, for its amax and then for the
    rounded values (the second pass from L2)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    if ONE_PASS:
        k = tl.arange(0, BLOCK)
        mask = k < K
        v = _row_values(x_row, k, mask, K, SILU_MUL)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX) / FP8_MAX
            tl.store(s_ptr + row * s_stride, scale)
        v = tl.clamp(v / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * q_stride + k, v.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                k = k0 + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(_row_values(x_row, k, k < K, K, SILU_MUL)))
            scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX
            tl.store(s_ptr + row * s_stride, scale)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            mask = k < K
            v = tl.clamp(_row_values(x_row, k, mask, K, SILU_MUL) / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + row * q_stride + k, v.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, s_stride, s_group_stride,
    GROUPS_PER_PROGRAM: tl.constexpr, GROUP_K: tl.constexpr, SILU_MUL: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    """One program per (row, GROUPS_PER_PROGRAM groups of GROUP_K columns): the tile [groups, GROUP_K] is
    read once, each group's amax taken along its row of the tile."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    k = g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    mask = k < K
    v = _row_values(x_ptr + row * x_stride, k, mask, K, SILU_MUL)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), MIN_AMAX) / FP8_MAX
    tl.store(s_ptr + row * s_stride + g * s_group_stride, scale, mask=g * GROUP_K < K)
    q = tl.clamp(v / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * q_stride + k, q.to(q_ptr.dtype.element_ty), mask=mask)


GROUPS_PER_PROGRAM = 8
ROW_IN_REGISTERS = 16384  # the longest row the row kernel holds whole (32 values a thread at 16 warps)


def quantize(x: torch.Tensor, scale: torch.Tensor | None = None, group: int | None = None,
             silu_mul: bool = False, pad_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_ref's rounding in one launch; group scales come M-major (stride (1, rows)). pad_rows: that
    many more rows in q and s, left unwritten (their products are thrown away)."""
    T = x.shape[0]
    K = x.shape[1] // 2 if silu_mul else x.shape[1]
    q = torch.empty(T + pad_rows, K, dtype=FP8, device=x.device)
    group_k = group or K
    groups = triton.cdiv(K, group_k)
    dynamic = scale is None
    s = torch.empty(groups, T + pad_rows, dtype=torch.float32, device=x.device).t() if dynamic else scale
    if T and group is not None and dynamic:
        assert group & (group - 1) == 0, group
        _quantize_groups_kernel[(T, triton.cdiv(groups, GROUPS_PER_PROGRAM))](
            x, q, s, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            GROUPS_PER_PROGRAM=GROUPS_PER_PROGRAM, GROUP_K=group, SILU_MUL=silu_mul,
            FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=4,
        )
    elif T:
        block = min(triton.next_power_of_2(K), ROW_IN_REGISTERS)
        _quantize_row_kernel[(T,)](
            x, q, s, s, K, x.stride(0), q.stride(0), s.stride(0) if dynamic else 0,
            BLOCK=block, ONE_PASS=K <= block, STATIC=not dynamic, SILU_MUL=silu_mul,
            FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=min(max(block // 512, 2), 16),
        )
    return q, s


@triton.jit
def _fp8_gemm_kernel(
    q_ptr, s_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, M, N, K,
    q_stride, s_stride, s_group_stride, w_stride, ws_stride, y_stride,
    BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    """y tile [BLOCK_M, BLOCK_N] = sum over K of fp8 dots in fp32. BLOCKS: each BLOCK_K (= the group)
    step's dot is scaled by the rows' group scales and the weight block's scale (BLOCK_N divides
    GROUP_N); else the sum is scaled once, by the rows' and the channels' scales."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    a_ptrs = q_ptr + m[:, None].to(tl.int64) * q_stride + kk[None, :]
    b_ptrs = w_ptr + n[None, :].to(tl.int64) * w_stride + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_block = (pid_n * BLOCK_N) // GROUP_N
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = g * BLOCK_K + kk < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if BLOCKS:
            a_s = tl.load(s_ptr + m * s_stride + g * s_group_stride, mask=m_ok, other=0.0)
            b_s = tl.load(ws_ptr + n_block * ws_stride + g)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCKS:
        a_s = tl.load(s_ptr + m * s_stride, mask=m_ok, other=0.0)
        acc *= a_s[:, None] * tl.load(ws_ptr + n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None].to(tl.int64) * y_stride + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def pick_tile(M: int, N: int, K: int, blocks: bool, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for an [M, K] x [K, N] fp8 product (a fit of
    benchmarks/fp8_gemm.py --tune on an H200): up to 16 rows one row tile, as wide as still gives every
    SM a program; then 64 x 64 tiles (BLOCK_K 256) up to 128 rows or N = 2,048; past that 128 x 64, and
    128 x 128 for wide products (an MLP's gate/up past 64 rows, N >= 6,144 past 128); deeper pipelines
    for long rows. The block form (BLOCK_K = its group): 64 x 64, and 128 x 64 past 128 rows of K < 8,192."""
    stages = 5 if K >= 8192 else 3
    if M <= 16:
        block_n = next((n for n in (128, 64) if triton.cdiv(N, n) >= sms), 32)
        return 16, block_n, GROUP if blocks else 256, 4, stages
    if blocks:
        return (64, 64, GROUP, 4, stages) if M <= 128 or K >= 8192 else (128, 64, GROUP, 8, stages)
    if (M > 64 and N >= WIDE_N) or (M > 128 and N >= 6144):
        return 128, 128, 128, 8, 5 if K >= 4096 else 3
    if M <= 128 or N <= 2048:
        return 64, 64, 256, 4, stages
    return 128, 64, 128, 8, stages


def fp8_gemm(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, tile: tuple | None = None) -> torch.Tensor:
    """q [M, K] e4m3 with row scales s [M, 1] (or group scales [M, K/128] for a block-scaled W) times
    W [N, K] with channel scales [N] (or block scales [N/128, K/128]) -> [M, N] in out_dtype.
    tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), else from the tables."""
    M, K = q.shape
    N = weight.shape[0]
    blocks = weight_scale.dim() == 2
    y = torch.empty(M, N, dtype=out_dtype, device=q.device)
    if M == 0:
        return y
    if tile is None:
        tile = pick_tile(M, N, K, blocks, num_sms(q.device) if q.is_cuda else 132)
    block_m, block_n, block_k, warps, stages = tile
    if s.numel() == 1:  # a static scale: the same for every row
        s = s.reshape(1, 1).expand(M, 1)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _fp8_gemm_kernel[grid](
        q, s, weight, weight_scale, y, bias if bias is not None else y, M, N, K,
        q.stride(0), s.stride(0), s.stride(1), weight.stride(0), weight_scale.stride(0) if blocks else 0, y.stride(0),
        BLOCKS=blocks, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=GROUP if blocks else block_k, GROUP_N=GROUP, num_warps=warps, num_stages=stages,
    )
    return y


TMA_MAX_ROWS = 256  # past this cuBLAS's row-wise product serves every per-channel product


def tma_tile(M: int, N: int, K: int, parts_ok: bool, sms: int) -> Tile | None:
    """The tile of tile_gemm's TMA kernel for a per-channel fp8 product where it beats cuBLAS and the pointer
    kernel (benchmarks/fp8_gemm.py --tma on an H200), else None: o and down (N <= K) whose caller sums split-K
    parts (parts_ok) at up to 256 rows, K in the most parts (4, 2) that keep the grid within one program an SM
    (two for 16-row tiles); an MLP's gate/up (N >= WIDE_N) past 128 rows in 128 x 256 tiles; qkv-like
    products at 33 to 128 rows."""
    if not 0 < M <= TMA_MAX_ROWS:
        return None
    if N <= K and parts_ok:
        bm, bn, bk, stages, warps = ((16, 64, 256, 3, 4) if M <= 16 else (64, 64, 256, 5, 4) if M <= 64
                                     else (128, 128, 128, 5, 8))
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        budget = (2 if bm == 16 else 1) * sms
        split = next((s for s in (4, 2) if K % (s * bk) == 0 and tiles * s <= budget), 1)
        tile = (bm, bn, bk, stages, warps, split)
    elif N >= WIDE_N:
        tile = (128, 256, 128, 3, 8, 1) if M > 128 else None
    elif N > K and 32 < M <= 128:
        tile = (64, 64, 256, 5, 4, 1) if M <= 64 else (128, 64, 128, 5, 4, 1)
    else:
        tile = None
    return tile if tile is not None and K % tile[2] == 0 else None


def takes_scaled_mm(M: int, N: int, K: int) -> bool:
    """Whether cuBLAS's row-wise scaled product beats the Triton tiles (H200, --tune): past 256 rows, and
    for a wide product of a large weight (an 8B-sized gate/up: N >= 16,384 and N x K >= 2^26) past 64."""
    return M > 256 or (M > 64 and N >= WIDE_N and N * K >= 1 << 26)


BLOCKWISE_MIN_ROWS = 16  # past this many rows the block form takes cuBLAS (its K permitting)


def takes_blockwise_scaled_mm(M: int, N: int, K: int) -> bool:
    """Whether cuBLAS's blockwise product serves, and beats the Triton block kernel (H200): past 16 rows, and
    for long rows (K >= 8192: a down projection) at any count. cuBLAS reads the weight's block scales
    [K/128, N/128] with a leading dimension it wants a multiple of 4: K a multiple of 512 (smaller ones
    give wrong products on an H200, torch 2.11 / CUDA 13.0)."""
    return N % GROUP == 0 and K % (4 * GROUP) == 0 and (M > BLOCKWISE_MIN_ROWS or K >= 8192)


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLAS's fp8 product wants K and N multiples of 16 (and a GPU of compute capability >= 8.9)."""
    return x.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


@functools.cache
def blockwise_scaled_mm_ok(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes 1x128 x 128x128 block scales on this GPU: a Hopper (sm_90) and a torch
    built with CUDA >= 12.9 do; others raise, and the Triton kernel serves. Ask once outside graph
    capture (layers/fp8.finish_fp8 does, at load)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    # Ones times distinct scales (exact in fp32): y[m, n] = 128 * sum_g s[m, g] * ws[n // 128, g], which a
    # misread layout of either scale tensor gets wrong.
    f32 = dict(dtype=torch.float32, device=device)
    q = torch.ones(4, 4 * GROUP, dtype=FP8, device=device)
    w = torch.ones(2 * GROUP, 4 * GROUP, dtype=FP8, device=device)
    rows, groups, blocks = torch.arange(1, 5, **f32), torch.arange(4, **f32), torch.arange(1, 3, **f32)
    s = (rows[:, None] * torch.exp2(groups)[None, :]).t().contiguous().t()  # [4, 4], M-major, not symmetric
    ws = blocks[:, None] * (groups + 1)[None, :]  # [2, 4]
    want = GROUP * (s @ ws.t()).repeat_interleave(GROUP, dim=1)
    try:
        y = _blockwise_scaled_mm(q, s, w, ws, None, torch.float32)
    except (RuntimeError, TypeError, ValueError):
        return False
    return bool(torch.equal(y, want))


def _blockwise_scaled_mm(q, s, weight, weight_scale, bias, out_dtype):
    """cuBLAS's blockwise product: q [M, K] with s [M, K/128] M-major (M a multiple of 4: cuBLAS's leading
    dimension), weight_scale [N/128, K/128] read as its transpose."""
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.t(), out_dtype=out_dtype)
    return y if bias is None else y.add_(bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, silu_mul: bool = False, parts_ok: bool = False) -> torch.Tensor:
    """x [T, K] (or a gate/up pair [T, 2K] with silu_mul) @ W^T -> [T, N] in out_dtype (x's dtype).
    weight_scale: [N] per output channel, or [ceil(N/128), ceil(K/128)] blocks; input_scale: a static
    per-tensor scale (0-dim), or None for dynamic rounding (per token; per 128-group for blocks).
    parts_ok: the caller sums split-K parts, which may come back instead (fp32 [S, T, N], fp8_product)."""
    out_dtype = out_dtype or x.dtype
    block = weight_scale.dim() == 2
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, weight_scale, input_scale, bias, out_dtype, silu_mul)
    N, K = weight.shape
    M = x.shape[0]
    group = GROUP if block and input_scale is None else None
    blockwise = group is not None and takes_blockwise_scaled_mm(M, N, K) and blockwise_scaled_mm_ok(x.device)
    q, s = quantize(x, input_scale, group, silu_mul, pad_rows=-M % 4 if blockwise else 0)
    if blockwise:
        return _blockwise_scaled_mm(q, s, weight, weight_scale, bias, out_dtype)[:M]
    return fp8_product(q, s, weight, weight_scale, input_scale, bias, out_dtype, parts_ok)


def fp8_product(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
                parts_ok: bool = False) -> torch.Tensor:
    """fp8_linear's product of activations already rounded (q [M, K] e4m3 on a GPU with their scales s:
    per row [M, 1], or input_scale when static), except cuBLAS's block form: tile_gemm's TMA kernel where
    tma_tile has a tile (with parts_ok, o and down may come back as fp32 split-K parts [S, M, N]), else
    cuBLAS's row-wise product where it beats the pointer kernel, else that kernel."""
    M, K = q.shape
    N = weight.shape[0]
    if weight_scale.dim() == 2:
        return fp8_gemm(q, s, weight, weight_scale, bias, out_dtype)
    rows = s if input_scale is None else input_scale.reshape(1, 1).expand(M, 1)  # (static: one scale for all)
    tile = tma_tile(M, N, K, parts_ok and bias is None, num_sms(q.device))
    if tile is not None and tile_gemm_supported(q.device) and tma_ok(q) and tma_ok(weight):
        return tile_gemm_triton(q, weight, parts_ok=tile[5] > 1, tile=tile, bias=bias, out_dtype=out_dtype,
                                x_scale=rows, weight_scale=weight_scale)
    if not _scaled_mm_ok(q, weight) or not takes_scaled_mm(M, N, K):
        return fp8_gemm(q, s, weight, weight_scale, bias, out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=rows.contiguous(), scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=out_dtype)
