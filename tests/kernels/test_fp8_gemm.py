"""FP8 products (kernels/fp8_gemm.py) against their torch references."""
import pytest
import torch

import batchgen.kernels.fp8_gemm as fp8_gemm_module
from batchgen.kernels.e4m3 import FP8, GROUP, dequantize_weight_ref, quantize_ref, quantize_weight_ref
from batchgen.kernels.fp8_gemm import (
    TMA_MAX_ROWS,
    blockwise_scaled_mm_ok,
    fp8_gemm,
    fp8_linear,
    fp8_linear_ref,
    fp8_product,
    quantize,
    tma_tile,
)
from batchgen.kernels.rmsnorm import (
    add_rmsnorm_fp8,
    add_rmsnorm_fp8_ref,
    add_rmsnorm_parts_triton,
    add_rmsnorm_triton,
    rmsnorm_triton,
)
from batchgen.kernels.tile_gemm import tile_gemm_supported
from tests.kernels.conftest import HAS_CUDA, INTERPRET


def _x(shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)


def _assert_same_rounding(q, q_ref):
    """At most one e4m3 step apart, and only where x / s lands on a rounding boundary (the division's own
    rounding differs). The Triton interpreter drops the carry where rounding up crosses a power of two
    (126.8 -> 64, not 128): there it is checked only away from those values."""
    got, want = q.float(), q_ref.float()
    if INTERPRET and not HAS_CUDA:
        carry = (want.abs().log2() == want.abs().log2().round()) & (got != want)
        got = torch.where(carry, want, got)
    diff = (got - want).abs() / want.abs().clamp(min=2**-6)
    assert (diff > 0.13).sum() == 0 and (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("rows,cols", [(1, 40), (5, 130), (3, 300)])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("group", [None, GROUP])
def test_quantize_per_token_and_group(device, rows, cols, silu_mul, group):
    x = _x((rows, 2 * cols if silu_mul else cols), device)
    x[0, :3] = 0.0
    q, s = quantize(x, group=group, silu_mul=silu_mul)
    q_ref, s_ref = quantize_ref(x.cpu(), group=group, silu_mul=silu_mul)
    assert q.dtype == FP8 and q.shape == (rows, cols)
    assert s.shape == s_ref.shape == (rows, 1 if group is None else -(-cols // group))
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    _assert_same_rounding(q.cpu(), q_ref)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_longer_than_the_registers_hold(device, monkeypatch, silu_mul, static):
    """Rows past ROW_IN_REGISTERS are read twice (amax, then the values): the same rounding as one pass."""
    monkeypatch.setattr(fp8_gemm_module, "ROW_IN_REGISTERS", 64)
    cols = 300
    x = _x((3, 2 * cols if silu_mul else cols), device, seed=1)
    scale = torch.tensor(0.02, device=device) if static else None
    q, s = quantize(x, scale, silu_mul=silu_mul)
    q_ref, s_ref = quantize_ref(x.cpu(), None if scale is None else scale.cpu(), silu_mul=silu_mul)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    _assert_same_rounding(q.cpu(), q_ref)


@pytest.mark.parametrize("tokens,hidden", [(1, 64), (5, 300)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_rounds_rows_as_quantize_does(device, tokens, hidden, with_residual):
    """add_rmsnorm_fp8 (the norm's kernel rounding its output) gives the bits of the norm's 16-bit output
    rounded by quantize, and the reference's rounding."""
    x = _x((tokens, hidden), device, torch.bfloat16, seed=2)
    residual = _x((tokens, hidden), device, torch.bfloat16, seed=3) if with_residual else None
    weight = (1 + _x((hidden,), device, seed=4) / 10).to(torch.bfloat16)
    q, s, new_residual = add_rmsnorm_fp8(x, residual, weight, 1e-5)
    if residual is None:
        y, want_residual = rmsnorm_triton(x, weight, 1e-5), x
    else:
        y, want_residual = add_rmsnorm_triton(x, residual, weight, 1e-5)
    q_unfused, s_unfused = quantize(y)
    assert q.dtype == FP8 and s.shape == (tokens, 1)
    if HAS_CUDA:  # (the interpreter rounds some casts to bf16 by truncation, not always alike: no bits there)
        assert torch.equal(q.view(torch.uint8), q_unfused.view(torch.uint8)) and torch.equal(s, s_unfused)
        assert torch.equal(new_residual, want_residual)
    q_ref, s_ref, residual_ref = add_rmsnorm_fp8_ref(x.cpu(), None if residual is None else residual.cpu(),
                                                     weight.cpu(), 1e-5)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-2, atol=0)  # (the norms' own roundings differ)
    torch.testing.assert_close(q.cpu().float(), q_ref.float(), rtol=0.13, atol=2**-6)
    torch.testing.assert_close(new_residual.cpu(), residual_ref, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("tokens,hidden,num_parts", [(1, 64, 2), (5, 300, 4)])
def test_norm_sums_split_parts_then_rounds(device, tokens, hidden, num_parts):
    """add_rmsnorm_fp8 of split-K parts (an fp8 o or down's output) rounds the norm of their sum: the bits
    of add_rmsnorm_parts then quantize on a GPU, the reference's rounding anywhere."""
    parts = _x((num_parts, tokens, hidden), device, seed=5)
    residual = _x((tokens, hidden), device, torch.bfloat16, seed=6)
    weight = (1 + _x((hidden,), device, seed=7) / 10).to(torch.bfloat16)
    q, s, new_residual = add_rmsnorm_fp8(parts[0], residual, weight, 1e-5, parts)
    assert q.dtype == FP8 and s.shape == (tokens, 1)
    if HAS_CUDA:
        y, want_residual = add_rmsnorm_parts_triton(parts, residual, weight, 1e-5)
        q_unfused, s_unfused = quantize(y)
        assert torch.equal(q.view(torch.uint8), q_unfused.view(torch.uint8)) and torch.equal(s, s_unfused)
        assert torch.equal(new_residual, want_residual)
    q_ref, s_ref, residual_ref = add_rmsnorm_fp8_ref(parts[0].cpu(), residual.cpu(), weight.cpu(), 1e-5, parts.cpu())
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-2, atol=0)
    torch.testing.assert_close(q.cpu().float(), q_ref.float(), rtol=0.13, atol=2**-6)
    torch.testing.assert_close(new_residual.cpu(), residual_ref, rtol=1.6e-2, atol=1.6e-2)


def test_quantize_static_scale(device):
    x = _x((4, 64), device)
    scale = torch.tensor(0.02, device=device)
    q, s = quantize(x, scale)
    assert s is scale
    q_ref = quantize_ref(x.cpu(), scale.cpu())[0]
    assert q_ref.float().abs().max() == 448  # (some values clamped)
    _assert_same_rounding(q.cpu(), q_ref)


def test_quantize_all_zero_rows(device):
    q, s = quantize(torch.zeros(2, 32, device=device))
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_weight_quantization_round_trips():
    w = _x((200, 300), "cpu")
    for block in (False, True):
        q, s = quantize_weight_ref(w, block)
        assert q.dtype == FP8 and s.shape == ((2, 3) if block else (200,))
        back = fp8_linear_ref(torch.eye(300), q, s).t()  # a product with I dequantizes (x rounded exactly)
        torch.testing.assert_close(back, w, rtol=0.07, atol=0.03)


def _assert_product_close(y, ref):
    """fp32 sums of exact fp8 products; Hopper's fp8 dot adds its products with fewer bits than fp32."""
    atol = 2e-3 * ref.abs().max().item() if HAS_CUDA else 1e-3
    torch.testing.assert_close(y, ref, rtol=2e-3 if HAS_CUDA else 1e-4, atol=atol)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_fp8_gemm_matches_reference(device, rows, blocks):
    """Awkward N and K (not multiples of the tiles or of 128), with a bias; each table's tiles."""
    w = _x((200, 300), "cpu", seed=1)
    wq, ws = quantize_weight_ref(w, block=blocks)
    x = _x((rows, 300), device, seed=2)
    bias = _x((200,), device, seed=3)
    q, s = quantize_ref(x.cpu(), group=GROUP if blocks else None)
    for tile in (None, (16, 32, 256, 4, 3)) if not blocks else (None,):
        y = fp8_gemm(q.to(device), s.to(device), wq.to(device), ws.to(device), bias, torch.float32, tile)
        _assert_product_close(y.cpu(), fp8_linear_ref(x.cpu(), wq, ws, bias=bias.cpu()))


@pytest.mark.parametrize("tile", [None, (16, 32, 256, 4, 3), (64, 64, 256, 4, 5), (128, 64, 128, 8, 3),
                                  (128, 128, 128, 8, 3)])
def test_fp8_gemm_tiles_and_static_scale(device, tile):
    wq, ws = quantize_weight_ref(_x((96, 200), "cpu", seed=5))
    x = _x((20, 200), device, seed=6)
    scale = torch.tensor(0.05)
    q, _ = quantize_ref(x.cpu(), scale)
    y = fp8_gemm(q.to(device), scale.to(device), wq.to(device), ws.to(device), None, torch.float32, tile)
    _assert_product_close(y.cpu(), fp8_linear_ref(x.cpu(), wq, ws, scale))


@pytest.mark.skipif(not HAS_CUDA, reason="cuBLAS's blockwise product runs on a GPU")
@pytest.mark.parametrize("rows,k", [(65, 512), (300, 1024), (16, 8192), (1, 8192), (130, 384)])
def test_block_form_through_cublas_matches_reference(rows, k):
    """Past 64 rows (or for long rows) the block form takes cuBLAS's blockwise product where this GPU has it,
    its rows padded to a multiple of 4; K = 384 stays on the Triton kernel (cuBLAS would get it wrong). The
    reference takes the kernel's own rounding of x (the GPU's division may round a value to the other side
    of an e4m3 boundary)."""
    if not blockwise_scaled_mm_ok(torch.device("cuda")):
        pytest.skip("no blockwise scaled product in this torch / on this GPU")
    wq, ws = quantize_weight_ref(_x((256, k), "cpu", seed=7), block=True)
    x = _x((rows, k), "cuda", dtype=torch.bfloat16, seed=8)
    bias = _x((256,), "cuda", seed=9)
    y = fp8_linear(x, wq.cuda(), ws.cuda(), bias=bias, out_dtype=torch.float32)
    q, s = quantize(x, group=GROUP)
    x_rounded = q.float().cpu() * s.cpu().repeat_interleave(GROUP, dim=1)[:, :k]
    _assert_product_close(y.cpu(), x_rounded @ dequantize_weight_ref(wq, ws).t() + bias.cpu())


@pytest.mark.parametrize("rows", [1, 16, 17, 33, 64, 65, 128, 129, 256, 257])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (2048, 8192), (6144, 4096), (28672, 4096),
                                 (896, 896), (4096, 4000)])
def test_tma_tiles_fit_their_product(rows, n, k):
    """Every tile tma_tile gives sums whole K steps in whole parts, keeps a split grid within its program
    budget, and splits only where the caller sums parts; none past TMA_MAX_ROWS rows."""
    sms = 132
    for parts_ok in (False, True):
        tile = tma_tile(rows, n, k, parts_ok, sms)
        if tile is None:
            continue
        bm, bn, bk, stages, warps, split = tile
        assert rows <= TMA_MAX_ROWS and k % (bk * split) == 0
        assert split == 1 or (parts_ok and n <= k)
        tiles = -(-rows // bm) * -(-n // bn)
        assert split == 1 or tiles * split <= (2 if bm == 16 else 1) * sms
    assert tma_tile(TMA_MAX_ROWS + 1, n, k, True, sms) is None and tma_tile(0, n, k, True, sms) is None


@pytest.mark.skipif(not (HAS_CUDA and tile_gemm_supported(torch.device("cuda"))), reason="TMA tiles: Hopper")
@pytest.mark.parametrize("rows", [1, 13, 40, 100, 200])
@pytest.mark.parametrize("n,k,parts_ok", [(512, 1024, True), (16384, 256, False), (768, 512, False)])
@pytest.mark.parametrize("static", [False, True])
def test_tma_form_matches_reference(rows, n, k, parts_ok, static):
    """fp8_product through tile_gemm's TMA kernel (split-K parts for o/down-like products, 128 x 256 tiles
    for a wide gate/up, qkv-like products) against the fp32 definition, with a static scale too."""
    wq, ws = quantize_weight_ref(_x((n, k), "cpu", seed=10))
    x = _x((rows, k), "cuda", dtype=torch.bfloat16, seed=11)
    scale = torch.tensor(0.05, device="cuda") if static else None
    q, s = quantize(x, scale)
    y = fp8_product(q, s, wq.cuda(), ws.cuda(), scale, None, torch.float32, parts_ok)
    if y.dim() == 3:
        assert parts_ok and y.shape[1:] == (rows, n)
        y = y.sum(0)
    s_rows = s.expand(rows, 1) if static else s
    _assert_product_close(y.cpu(), (q.float() * s_rows).cpu() @ dequantize_weight_ref(wq, ws).t())


def test_fp8_linear_reference_is_the_cpu_path():
    x = _x((3, 64), "cpu")
    wq, ws = quantize_weight_ref(_x((48, 64), "cpu", seed=4))
    assert torch.equal(fp8_linear(x, wq, ws), fp8_linear_ref(x, wq, ws))
