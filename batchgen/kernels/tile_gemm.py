"""Products of a decode step's rows (2 to 64, and 65 to 256 where start-up timing found them faster
than cuBLAS) on Hopper: y = x @ W^T in [BM, BN] output tiles, x and W read through TMA descriptors
(STAGES tiles of each in flight in shared memory), multiplied by the tensor cores, summed in fp32.

    y = x W^T                                (plain)
    y = silu(x Wg^T) * (x Wu^T)              (SILU_MUL_OUT: W = [Wg; Wu], an MLP's gate/up; y [M, N/2])
    parts[s] = x[:, Ks] W[:, Ks]^T           (SPLIT > 1: K in SPLIT slices Ks, fp32; y = sum_s parts[s])

    y = (p_0 + p_1 + ... + p_{C-1}) + bias     (CHUNKS = C > 1: p_c = x[:, Kc] W[:, Kc]^T, fp32, summed
                                              in order in the program: the same bits as SPLIT = C parts
                                              summed by add_rmsnorm_parts; kernels/invariant_gemm.py)

SILU_MUL_OUT keeps a gate and an up accumulator a program, so the pair never goes to memory and no
SiLU-and-mul kernel runs (gate and up rounded to x's dtype first, as the product would round them).
SPLIT gives products with few output columns (o, down) enough programs to stream W; the add + RMSNorm
after such a product sums the parts (rmsnorm.add_rmsnorm_parts).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import device_index, interpreting, num_sms, pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.silu_and_mul import silu_and_mul_ref
from batchgen.kernels.skinny_gemm import TensorDescriptor, tma_ok

MAX_ROWS = 64  # the most rows a product takes a tile at without start-up timing
MIN_PROGRAMS = 64  # a split plain product with fewer programs streams W too slowly (qwen2.5-0.5b's down)
# Above MAX_ROWS and up to TUNED_MAX_ROWS a product takes a tile only where start-up timing found one
# faster than cuBLAS for that shape and row count (executor/product_tuning.py): neither wins everywhere there
TUNED_MAX_ROWS = 256

Tile = tuple[int, int, int, int, int, int]  # (BM, BN, BK, stages, warps, SPLIT)
# (product_key) -> the tile timed faster than cuBLAS, or None where cuBLAS was (executor/product_tuning.py)
tuned: dict[tuple, Tile | None] = {}
_recording: dict[tuple, dict[int, torch.Tensor]] | None = None


@triton.jit(do_not_specialize=["M"])  # (one compile per tile height, not per row count: none inside a job)
def _tile_gemm_kernel(
    x_desc,  # [M, K], blocks [BM, BK]
    w_desc,  # [N, K], blocks [BN, BK]
    y_ptr,  # [M, N], or [M, N / 2] with SILU_MUL_OUT
    y_stride_m,
    part_ptr,  # [SPLIT, M, N] fp32 (SPLIT > 1)
    M,
    N_OUT,  # columns of y
    K_PER_SPLIT,  # a multiple of BK
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT: tl.constexpr,
    SILU_MUL_OUT: tl.constexpr,
    CHUNKS: tl.constexpr,  # > 1: K in CHUNKS slices of K_PER_SPLIT, each summed alone, then added in order
    HAS_BIAS: tl.constexpr,
    bias_ptr,  # [N] (HAS_BIAS)
    PDL: tl.constexpr,
    SCALED: tl.constexpr = False,  # x and W in e4m3: y = (x W^T) * x_scale[row] * w_scale[col]
    x_scale_ptr=None,  # [M] fp32, x_scale_stride apart (SCALED)
    x_scale_stride=0,
    w_scale_ptr=None,  # [N] fp32 (SCALED; a gate/up pair's up scales at N_OUT + col)
):
    pid_m = tl.program_id(0)  # (M tiles fastest: a W tile's second read, by the next M tile, hits the L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m0 = pid_m * BM
    n0 = pid_n * BN
    k_lo = pid_k * K_PER_SPLIT
    wait_for_prior_kernels(PDL)  # x is the kernel before's output
    acc, acc_up = _dot_k_range(x_desc, w_desc, m0, n0, N_OUT, k_lo, K_PER_SPLIT, BM, BN, BK, STAGES, SILU_MUL_OUT)
    for c in tl.static_range(1, CHUNKS):  # (the first chunk's sum is the total's start, as parts[0] is)
        acc += _dot_k_range(x_desc, w_desc, m0, n0, N_OUT, c * K_PER_SPLIT, K_PER_SPLIT, BM, BN, BK, STAGES,
                            False)[0]
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N_OUT)[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * y_stride_m + cols[None, :]
    dtype = y_ptr.dtype.element_ty
    if SCALED:  # (row scale times channel scale first, as kernels/fp8_gemm.py's pointer kernel applies them)
        row_scale = tl.load(x_scale_ptr + rows * x_scale_stride, mask=rows < M, other=0.0)[:, None]
        acc *= row_scale * tl.load(w_scale_ptr + cols, mask=cols < N_OUT, other=0.0)[None, :]
        if SILU_MUL_OUT:
            acc_up *= row_scale * tl.load(w_scale_ptr + N_OUT + cols, mask=cols < N_OUT, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N_OUT, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL_OUT:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        tl.store(y_ptrs, (gate * tl.sigmoid(gate) * up).to(dtype), mask=mask)
    elif SPLIT == 1:
        tl.store(y_ptrs, acc.to(dtype), mask=mask)
    else:  # this split's fp32 part (the add + RMSNorm after the product sums the parts)
        part_ptrs = part_ptr + pid_k.to(tl.int64) * M * N_OUT + rows[:, None].to(tl.int64) * N_OUT + cols[None, :]
        tl.store(part_ptrs, acc, mask=mask)


@triton.jit
def _dot_k_range(x_desc, w_desc, m0, n0, N_OUT, k_lo, k_len, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, SILU_MUL_OUT: tl.constexpr):
    """(x W^T, x Wu^T) of the tile over K in [k_lo, k_lo + k_len), BK at a time from zero (fp32)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)  # (SILU_MUL_OUT only)
    for k in tl.range(k_lo, k_lo + k_len, BK, num_stages=STAGES):
        a = x_desc.load([m0, k])
        w = w_desc.load([n0, k])
        acc = tl.dot(a, w.T, acc)
        if SILU_MUL_OUT:
            u = w_desc.load([N_OUT + n0, k])
            acc_up = tl.dot(a, u.T, acc_up)
    return acc, acc_up


@functools.cache
def _supported(device_index: int) -> bool:
    if TensorDescriptor is None or interpreting():
        return False
    # Hopper and datacenter Blackwell: the tiles' stages take up to ~110 KB of shared memory, more than
    # consumer parts (sm_120, ~99 KB) give a program
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def tile_gemm_supported(device: torch.device) -> bool:
    """Whether decode products may take this kernel: a Hopper or datacenter Blackwell GPU (TMA, shared
    memory for the tiles' stages), Triton with host-side descriptors."""
    return device.type == "cuda" and _supported(device_index(device))


def pick_tile(m: int, n_out: int, k: int, silu_mul_out: bool, parts_ok: bool = False, sms: int = 132) -> Tile | None:
    """The tile for m rows, or None where K is not whole BK steps. BM is the fewest of 16, 32, 64, 128
    rows that hold m (TMA fills rows past x with zeros). With parts_ok a plain product splits K in the
    most parts (4 or 2) that keep the grid within one program an SM."""
    bm = next(b for b in (16, 32, 64, 128) if m <= b or b == 128)
    bn = 64
    bk, warps = 128, 8 if bm == 128 else 4
    stages = 3 if silu_mul_out or bm == 128 else 5
    if k % bk:
        return None
    tiles = triton.cdiv(n_out, bn) * triton.cdiv(m, bm)
    split = 1
    if parts_ok and not silu_mul_out:
        split = next((s for s in (4, 2) if k % (s * bk) == 0 and tiles * s <= sms), 1)
    return bm, bn, bk, stages, warps, split


def candidate_tiles(m: int, n_out: int, k: int, silu_mul_out: bool, sms: int = 132) -> list[Tile]:
    """The tiles start-up timing tries against cuBLAS at MAX_ROWS < m <= TUNED_MAX_ROWS rows: 128-row
    tiles (M tiles run side by side, so W is read from DRAM once), 64 or 128 columns, and for plain
    products K in the most parts (4, 2) that keep the grid within one program an SM; up to 192 rows
    also pick_tile's 64-row tile, two or three M tiles."""
    # (BM, BN, BK, stages, warps)
    shapes = ([(128, 128, 64, 4, 8), (128, 64, 128, 3, 8)] if silu_mul_out
              else [(128, 128, 128, 3, 8), (128, 64, 128, 3, 8)])
    if m <= 192:
        shapes.append((64, 64, 128, 3 if silu_mul_out else 5, 4))
    tiles = []
    for bm, bn, bk, stages, warps in shapes:
        if k % bk:
            continue
        grid = triton.cdiv(n_out, bn) * triton.cdiv(m, bm)
        split = 1 if silu_mul_out else next((s for s in (4, 2) if k % (s * bk) == 0 and grid * s <= sms), 1)
        tiles.append((bm, bn, bk, stages, warps, split))
    return tiles


def product_key(x: torch.Tensor, weight: torch.Tensor, silu_mul_out: bool, parts_ok: bool) -> tuple:
    """What a tuned choice is kept under: the product's shape, dtype and kind, and its rows."""
    return (*weight.shape, str(x.dtype).removeprefix("torch."), silu_mul_out, parts_ok, x.shape[0])


@contextlib.contextmanager
def recording_products():
    """Within: every product tile_for is asked about with MAX_ROWS < rows <= TUNED_MAX_ROWS, by
    product_key less its rows -> {id(weight): weight} (the weights of every layer of that shape)."""
    global _recording
    _recording = seen = {}
    try:
        yield seen
    finally:
        _recording = None


def uses_tile_gemm(x: torch.Tensor, weight: torch.Tensor, silu_mul_out: bool = False,
                   parts_ok: bool = False) -> bool:
    """Whether a GPU product of x with weight goes to this kernel (tile_for's docstring)."""
    return tile_for(x, weight, silu_mul_out, parts_ok) is not None


def tile_for(x: torch.Tensor, weight: torch.Tensor, silu_mul_out: bool = False,
             parts_ok: bool = False) -> Tile | None:
    """The tile of a GPU product of x [M, K] with weight [N, K] where it goes to this kernel (else None):
    2 to 64 rows, 16-bit, Hopper, and the kinds it beats cuBLAS at: an MLP's gate/up with its SiLU-and-mul
    (silu_mul_out) in one wave of programs; products with N <= K (o, down) whose caller sums split-K parts
    (parts_ok), with at least MIN_PROGRAMS programs. At 65 to TUNED_MAX_ROWS rows: the tile start-up
    timing chose (`tuned`), if any."""
    m = x.shape[0]
    n, k = weight.shape
    if not (x.dim() == 2 and 2 <= m <= TUNED_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and tile_gemm_supported(x.device) and tma_ok(x) and tma_ok(weight)):
        return None
    if not silu_mul_out and not (parts_ok and n <= k):
        return None
    if m > MAX_ROWS:  # where start-up timing chose a tile (executor/product_tuning.py)
        key = product_key(x, weight, silu_mul_out, parts_ok)
        if _recording is not None:
            _recording.setdefault(key[:-1], {})[id(weight)] = weight
        return tuned.get(key)
    n_out = n // 2 if silu_mul_out else n
    sms = _sm_count(x.device)
    tile = pick_tile(m, n_out, k, silu_mul_out, parts_ok, sms)
    if tile is None:
        return None
    bm, bn, _, _, _, split = tile
    programs = triton.cdiv(n_out, bn) * triton.cdiv(m, bm) * split
    # gate/up in one wave of programs (in more, cuBLAS was faster)
    return tile if (programs <= sms if silu_mul_out else programs >= MIN_PROGRAMS) else None


def _sm_count(device: torch.device) -> int:
    return num_sms(device) if device.type == "cuda" else 132  # (an H100's or H200's: CPU tests)


def tile_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, silu_mul_out: bool = False, parts_ok: bool = False,
    tile: Tile | None = None, out: torch.Tensor | None = None, *, chunks: int = 1,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    x_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] (into out when given), or with silu_mul_out
    silu(x Wg^T) * (x Wu^T) -> [M, N / 2] (weight = [Wg; Wu]), or where the tile splits K (parts_ok) the
    fp32 parts [SPLIT, M, N] whose sum is the product (out is then unused). tile: pick_tile's unless
    given. chunks > 1 (no split): K summed in that many slices, added in order (the module's docstring).
    out_dtype: y's dtype (x's by default; fp32 for logits). x_scale [M, 1] and weight_scale [N] (fp32):
    x and weight are e4m3 (kernels/fp8_gemm.py's per-token and per-channel form), y in out_dtype."""
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if silu_mul_out else n
    scaled = weight_scale is not None
    out_dtype = out_dtype or (torch.bfloat16 if scaled else x.dtype)
    assert 0 < m and weight.shape[1] == k and x.dtype == weight.dtype
    assert x.dtype in ((torch.float8_e4m3fn,) if scaled else (torch.float16, torch.bfloat16)), \
        "16-bit, or e4m3 with scales: the dots run in their default precision"
    assert not scaled or (x_scale is not None and x_scale.shape[0] == m and weight_scale.shape == (n,))
    assert tma_ok(x) and tma_ok(weight), "TMA needs 16-byte aligned, row-contiguous x and W"
    assert not silu_mul_out or n % 2 == 0
    bm, bn, bk, stages, warps, split = tile or pick_tile(m, n_out, k, silu_mul_out, parts_ok, _sm_count(x.device))
    assert k % (split * chunks * bk) == 0 and (split == 1 or chunks == 1)
    assert bias is None or split == 1, "a bias is added once, not to each part"
    assert not silu_mul_out or (split == chunks == 1 and bias is None)
    if split > 1:
        y = parts = torch.empty((split, m, n_out), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((m, n_out), dtype=out_dtype, device=x.device) if out is None else out
        assert y.shape == (m, n_out) and y.stride(1) == 1 and y.dtype == out_dtype
        parts = y  # (unused)
    _tile_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n_out, bn), split)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]), y, y.stride(-2),
        parts, m, n_out, k // (split * chunks), BM=bm, BN=bn, BK=bk, STAGES=stages, SPLIT=split,
        SILU_MUL_OUT=silu_mul_out, CHUNKS=chunks, HAS_BIAS=bias is not None,
        bias_ptr=bias if bias is not None else y, num_warps=warps, num_stages=stages, **pdl_launch_args(x.device),
        **(dict(SCALED=True, x_scale_ptr=x_scale, x_scale_stride=x_scale.stride(0), w_scale_ptr=weight_scale)
           if scaled else {}),
    )
    return y


def tile_gemm_ref(x: torch.Tensor, weight: torch.Tensor, silu_mul_out: bool = False) -> torch.Tensor:
    """fp32 products rounded to x's dtype; with silu_mul_out, silu_and_mul of the rounded gate/up pair."""
    y = (x.float() @ weight.float().t()).to(x.dtype)
    return silu_and_mul_ref(y) if silu_mul_out else y


def tile_gemm(x: torch.Tensor, weight: torch.Tensor, silu_mul_out: bool = False, parts_ok: bool = False,
              tile: Tile | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """tile_gemm_triton on a GPU; on CPU the reference (never parts)."""
    if x.is_cuda:
        return tile_gemm_triton(x, weight, silu_mul_out, parts_ok, tile, out)
    y = tile_gemm_ref(x, weight, silu_mul_out)
    return y if out is None else out.copy_(y)
