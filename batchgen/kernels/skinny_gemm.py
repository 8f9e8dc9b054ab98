"""Products with few rows (decode of one sequence): y = x @ W^T (+ b), x [M, K] with M <= 8, W [N, K]
(the engine calls it at one row). Such a product is a stream of W: each program reads BLOCK_N rows of
W once, in BLOCK_K-wide chunks, keeping every x row's partial sums in fp32.

    y[m, n] = sum_k x[m, k] * W[n, k]                   (plain)
    y[m, n] = sum_k silu(g[m, k]) * u[m, k] * W[n, k]   (SILU_MUL, g = x[:, :K], u = x[:, K:])
    y[m, n] = sum_k rmsnorm(x + r)[m, k] * W[n, k]       (NORM; rounded as kernels/rmsnorm.py rounds)

SILU_MUL and NORM save the kernel before the product (program 0 writes x + residual). W must be a
constant: under PDL each program reads its first chunk (two where the product has few programs)
before its wait. On Hopper, one row with K <= TMA_MAX_K and at least TMA_MIN_WEIGHT weight elements
takes `_tma_row_kernel` instead: W through TMA, chunks pipelined in shared memory, no norm (its norm
runs in the norm kernel before it).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import device_index, interpreting, pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.rmsnorm import add_residual, add_rmsnorm_ref, rmsnorm_ref
from batchgen.kernels.silu_and_mul import silu_and_mul_ref

MAX_ROWS = 8
# A program reads two chunks of W before its PDL wait (instead of one) only where its product has few
# programs, at most ~2 an SM: there each program's loads in flight bound the stream (with many programs
# the second chunk's registers cost more)
PREFETCH_MAX_PROGRAMS = 256
# One-row products with rows of at most TMA_MAX_K and at least TMA_MIN_WEIGHT weight elements read W
# through TMA where the GPU has it (see the module's docstring)
TMA_MAX_K = 1024
TMA_MIN_WEIGHT = 1 << 23

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@functools.cache
def _tma_supported(device_index: int) -> bool:
    if TensorDescriptor is None or interpreting():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def tma_supported(device: torch.device) -> bool:
    """Whether one-row products on this device may read W through TMA descriptors (Hopper and later)."""
    return device.type == "cuda" and _tma_supported(device_index(device))


def tma_ok(weight: torch.Tensor) -> bool:
    """Whether W can have a TMA descriptor: 16-byte aligned base and row stride, contiguous rows."""
    return TensorDescriptor is not None and weight.dim() == 2 and weight.stride(1) == 1 and (
        weight.data_ptr() % 16 == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0)


@triton.jit
def _input_values(
    x_ptr, x_offs, res_ptr, res_offs, mask, norm_w_ptr, k, k_ok, rstd, K,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """The product's input at x_offs (any shape; its last axis the columns k), in fp32: x, silu(g) * u,
    or rmsnorm(x + r) * w rounded as add_rmsnorm rounds it (the sum, the normalised row and the
    weighted row each to x's dtype); rstd broadcasts against x_offs."""
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if SILU_MUL:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + x_offs + K, mask=mask, other=0.0).to(tl.float32)
        return gate * tl.sigmoid(gate) * up
    if NORM:
        if HAS_RESIDUAL:  # (x may be an fp32 sum)
            x = add_residual(x, tl.load(res_ptr + res_offs, mask=mask, other=0.0))
        w = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w
        return normed.to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _input_chunk(
    x_ptr, x_stride_m, res_ptr, res_stride_m, norm_w_ptr, rstd, m, m_ok, k, k_ok, K,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """_input_values at columns k of rows m: [BLOCK_M, BLOCK_K]."""
    mask = m_ok[:, None] & k_ok[None, :]
    x_offs = m[:, None].to(tl.int64) * x_stride_m + k[None, :]
    res_offs = m[:, None].to(tl.int64) * res_stride_m + k[None, :]
    return _input_values(x_ptr, x_offs, res_ptr, res_offs, mask, norm_w_ptr, k[None, :], k_ok[None, :],
                         rstd[:, None], K, SILU_MUL, NORM, HAS_RESIDUAL)


@triton.jit
def _weight_chunk(w_ptrs, k_ok, EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] of W at the columns k_ok marks valid (no mask when K % BLOCK_K == 0)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
    return w


@triton.jit
def _accumulate(
    acc, w, x_ptr, x_stride_m, res_ptr, res_stride_m, norm_w_ptr, rstd, m, m_ok, k, K,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DEFER_SUM: tl.constexpr,
):
    """acc + the product of the input's columns k with W's chunk w: per lane [BLOCK_M, BLOCK_N,
    BLOCK_K] (DEFER_SUM) or summed over the chunk [BLOCK_M, BLOCK_N]."""
    x = _input_chunk(x_ptr, x_stride_m, res_ptr, res_stride_m, norm_w_ptr, rstd, m, m_ok, k, k < K, K,
                     SILU_MUL, NORM, HAS_RESIDUAL)
    prod = x[:, None, :] * w.to(tl.float32)[None, :, :]
    if DEFER_SUM:  # (not an early return: Triton compiles the code after a constexpr if's return too)
        acc += prod
    else:
        acc += tl.sum(prod, axis=2)
    return acc


@triton.jit(do_not_specialize=["eps"])
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], or [M, 2K] gate/up when SILU_MUL
    x_stride_m,
    w_ptr,  # [N, K], rows contiguous
    w_stride_n,
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    y_ptr,  # [M, N]
    y_stride_m,
    res_ptr,  # [M, K] residual added to x before the norm (HAS_RESIDUAL)
    res_stride_m,
    new_res_ptr,  # [M, K] x + residual, written by program 0 (HAS_RESIDUAL)
    new_res_stride_m,
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    eps,
    N,
    K,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,  # rows of W per program
    BLOCK_K: tl.constexpr,  # columns of W per iteration
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks on W in the loop
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,  # the input is rmsnorm(x (+ residual)) * norm weight
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DEFER_SUM: tl.constexpr,  # keep [BLOCK_M, BLOCK_N, BLOCK_K] partials, sum once at the end
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
    PRE_CHUNKS: tl.constexpr,  # chunks of W read before the wait: 1, or 2 when K > BLOCK_K
    STATS_K: tl.constexpr = 0,  # NORM: columns of x a step of the statistics pass (see stats_columns)
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(rows, N - 1).to(tl.int64)  # the last program re-reads row N-1 instead of masking
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + w_rows[:, None] * w_stride_n + cols[None, :]
    # W's first chunk is read while the kernel before may still run (PDL, kernels/device.py): a constant
    first_w = _weight_chunk(w_ptrs, cols < K, EVEN_K)
    if PRE_CHUNKS == 2:
        second_w = _weight_chunk(w_ptrs + BLOCK_K, BLOCK_K + cols < K, EVEN_K)
    else:
        second_w = first_w  # (unused)
    wait_for_prior_kernels(PDL)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:  # every program reads the rows once more (from L2) for their statistics
        stats_cols = tl.arange(0, STATS_K)
        squares = tl.zeros((BLOCK_M, STATS_K), dtype=tl.float32)
        for k0 in range(0, K, STATS_K):
            k = k0 + stats_cols
            mask = m_ok[:, None] & (k < K)[None, :]
            x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride_m + k[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + m[:, None].to(tl.int64) * res_stride_m + k[None, :], mask=mask, other=0.0)
                x = add_residual(x, r)
                if pid == 0:
                    tl.store(new_res_ptr + m[:, None].to(tl.int64) * new_res_stride_m + k[None, :], x, mask=mask)
            xf = x.to(tl.float32)
            squares += xf * xf
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
    if DEFER_SUM:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate(acc, first_w, x_ptr, x_stride_m, res_ptr, res_stride_m, norm_w_ptr, rstd, m, m_ok, cols, K,
                      SILU_MUL, NORM, HAS_RESIDUAL, DEFER_SUM)
    if PRE_CHUNKS == 2:
        acc = _accumulate(acc, second_w, x_ptr, x_stride_m, res_ptr, res_stride_m, norm_w_ptr, rstd, m, m_ok,
                          BLOCK_K + cols, K, SILU_MUL, NORM, HAS_RESIDUAL, DEFER_SUM)
    for k0 in range(PRE_CHUNKS * BLOCK_K, K, BLOCK_K):
        w = _weight_chunk(w_ptrs + k0, k0 + cols < K, EVEN_K)
        acc = _accumulate(acc, w, x_ptr, x_stride_m, res_ptr, res_stride_m, norm_w_ptr, rstd, m, m_ok, k0 + cols, K,
                          SILU_MUL, NORM, HAS_RESIDUAL, DEFER_SUM)
    if DEFER_SUM:
        y = tl.sum(acc, axis=2)
    else:
        y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    y_ptrs = y_ptr + m[:, None].to(tl.int64) * y_stride_m + rows[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rows < N)[None, :])


@triton.jit
def _tma_row_kernel(
    x_ptr,  # [1, K], or [1, 2K] gate/up when SILU_MUL
    w_desc,  # TMA descriptor of W [N, K], blocks [BLOCK_N, BLOCK_K]
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    y_ptr,  # [1, N]
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # chunks of W in flight a program (shared-memory buffers)
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: y[n] = sum_k input[k] W[n, k], summed as _skinny_gemm_kernel's DEFER_SUM (fp32 per
    lane, one sum at the end), W read through TMA (rows and columns past W read as zeros); the row is
    a [BLOCK_K] vector broadcast over the [BLOCK_N, BLOCK_K] chunk (no axis for rows of x)."""
    pid = tl.program_id(0)
    row0 = pid * BLOCK_N
    cols = tl.arange(0, BLOCK_K)
    first_w = w_desc.load([row0, 0])  # before the PDL wait: W is a constant
    wait_for_prior_kernels(PDL)
    # x or silu(g) * u (no residual, no norm: x_ptr stands in for their unused pointers)
    x = _input_values(x_ptr, cols, x_ptr, cols, cols < K, x_ptr, cols, cols < K, 0.0, K, SILU_MUL, False, False)
    acc = first_w.to(tl.float32) * x[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + cols
        w = w_desc.load([row0, k0])
        x = _input_values(x_ptr, k, x_ptr, k, k < K, x_ptr, k, k < K, 0.0, K, SILU_MUL, False, False)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    rows = row0 + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


Tile = tuple[int, int, int, int, bool]  # (BLOCK_N, BLOCK_K, warps, stages, DEFER_SUM)
TmaTile = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, warps, stages): a tile of _tma_row_kernel


def default_tile(n: int, k: int) -> Tile:
    """(BLOCK_N, BLOCK_K, warps, stages, DEFER_SUM) at one row: long streams (gate/up, LM heads) sum each
    chunk as it comes; smaller weights keep per-lane partials, and weights of at most 2048 rows take 4
    rows a program so that ~4 programs share each SM."""
    if n * k >= 1 << 25:
        return (8, 1024, 4, 1, False)
    if n <= 2048:
        return (4, 1024, 8, 1, True)
    return (8, 1024, 4, 1, True)


def tma_tile(n: int, k: int) -> TmaTile:
    """256 columns a chunk, 5 stages of 4 warps; 16 rows a program for LM heads, 8 elsewhere."""
    return (16, 256, 4, 5) if n * k >= 1 << 27 else (8, 256, 4, 5)


def uses_tma(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of x with weight goes to _tma_row_kernel (see the module's docstring)."""
    n, k = weight.shape
    return (x.shape[0] == 1 and k <= TMA_MAX_K and n * k >= TMA_MIN_WEIGHT and tma_supported(x.device)
            and tma_ok(weight))


def stats_columns(num_rows: int, k: int, block_k: int) -> int:
    """Columns of x a step of a normed product's statistics pass: the whole row in one load where
    the rows hold at most 4,096 values (each step is a round trip to L2 before the stream goes on),
    else BLOCK_K."""
    whole = triton.next_power_of_2(k)
    return whole if triton.next_power_of_2(num_rows) * whole <= 4096 else block_k


def prefetched_chunks(num_programs: int, k: int, block_k: int) -> int:
    """Chunks of W (1 or 2) a program reads before its PDL wait: see PREFETCH_MAX_PROGRAMS."""
    return 2 if k > block_k and num_programs <= PREFETCH_MAX_PROGRAMS else 1


def _launch(x, weight, bias, out_dtype, tile, silu_mul=False, residual=None, norm_weight=None, eps=0.0, out=None):
    num_rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert num_rows <= MAX_ROWS and x.shape[1] == (2 * k if silu_mul else k)
    assert x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.is_contiguous())
    out_dtype = out_dtype or (x.dtype if residual is None else residual.dtype)
    y = torch.empty((num_rows, n), dtype=out_dtype, device=x.device) if out is None else out
    assert y.shape == (num_rows, n) and y.stride(1) == 1 and y.dtype == out_dtype
    new_residual = x
    if residual is not None:  # (x may then be an fp32 sum: layers/one_row_mlp.py)
        assert residual.shape == x.shape and residual.stride(1) == 1 and x.dtype in (residual.dtype, torch.float32)
        new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return y, new_residual
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous() and norm_weight.dtype == new_residual.dtype
    tma = (uses_tma(x, weight) and norm_weight is None) if tile is None else len(tile) == 4
    if tma:
        assert num_rows == 1 and norm_weight is None and tma_ok(weight), "TMA: one row, no norm, an aligned W"
        return _launch_tma(x, weight, bias, y, silu_mul, tile), new_residual
    block_n, block_k, num_warps, num_stages, defer = tile or default_tile(n, k)
    block_k = min(block_k, triton.next_power_of_2(k))
    num_programs = triton.cdiv(n, block_n)
    pre_chunks = prefetched_chunks(num_programs, k, block_k)
    _skinny_gemm_kernel[(num_programs,)](
        x, x.stride(0), weight, weight.stride(0), weight if bias is None else bias, y, y.stride(0),
        x if residual is None else residual, 0 if residual is None else residual.stride(0),
        new_residual, new_residual.stride(0), weight if norm_weight is None else norm_weight, eps, n, k,
        M=num_rows, BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, SILU_MUL=silu_mul, NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, DEFER_SUM=defer, PRE_CHUNKS=pre_chunks,
        STATS_K=stats_columns(num_rows, k, block_k),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch_args(x.device),
    )
    return y, new_residual


def _launch_tma(x, weight, bias, y, silu_mul, tile):
    n, k = weight.shape
    block_n, block_k, num_warps, num_stages = tile or tma_tile(n, k)
    block_k = min(block_k, triton.next_power_of_2(k))
    _tma_row_kernel[(triton.cdiv(n, block_n),)](
        x, TensorDescriptor.from_tensor(weight, [block_n, block_k]), weight if bias is None else bias, y, n, k,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch_args(x.device),
    )
    return y


def skinny_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    out_dtype: torch.dtype | None = None, tile: Tile | TmaTile | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (or gate/up [M, 2K] with silu_mul) @ weight [N, K]^T (+ bias [N]) -> [M, N] in
    out_dtype (default x's), into out when given."""
    return _launch(x, weight, bias, out_dtype, tile, silu_mul=silu_mul, out=out)[0]


def normed_skinny_gemm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | TmaTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) @ weight^T (+ bias), x + residual), or with no residual
    (rmsnorm(x) @ weight^T (+ bias), x): add_rmsnorm and the product in one launch."""
    return _launch(x, weight, bias, None, tile, residual=residual, norm_weight=norm_weight, eps=eps)


def skinny_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """fp32 products of x's values (silu(g) * u in fp32 with silu_mul), rounded once to out_dtype."""
    xf = silu_and_mul_ref(x.float()) if silu_mul else x.float()
    y = xf @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype or x.dtype)


def normed_skinny_gemm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        normed, new_residual = rmsnorm_ref(x, norm_weight, eps), x
    else:  # (x may be an fp32 sum, rounded first as a product's output)
        normed, new_residual = add_rmsnorm_ref(x.to(residual.dtype), residual, norm_weight, eps)
    return skinny_gemm_ref(normed, weight, bias), new_residual


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.is_cuda:
        return skinny_gemm_triton(x, weight, bias, silu_mul, out_dtype, out=out)
    y = skinny_gemm_ref(x, weight, bias, silu_mul, out_dtype)
    if out is None:
        return y
    assert out.shape == y.shape and out.dtype == y.dtype
    return out.copy_(y)


def normed_skinny_gemm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        return normed_skinny_gemm_triton(x, residual, norm_weight, eps, weight, bias)
    return normed_skinny_gemm_ref(x, residual, norm_weight, eps, weight, bias)
