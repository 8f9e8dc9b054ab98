import pytest
import torch

import batchgen.kernels.skinny_gemm as skinny
from batchgen.kernels.skinny_gemm import (
    normed_skinny_gemm_ref,
    normed_skinny_gemm_triton,
    skinny_gemm_ref,
    skinny_gemm_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, N, K): one row, rows past a power of two, N not a multiple of BLOCK_N, K not a multiple of
# BLOCK_K; llama-3.2-1b's down and qkv on the GPU.
SHAPES = [(1, 8, 64), (3, 37, 96), (8, 19, 700)] + [
    pytest.param(m, n, k, marks=pytest.mark.gpu) for m, n, k in [(1, 2048, 8192), (5, 3072, 2048)]
]
# (BLOCK_N, BLOCK_K, warps, stages, DEFER_SUM): the shape's default, and the other accumulation
TILES = [None, (4, 64, 4, 1, False)]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("silu_mul,bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_skinny_gemm(device, assert_close, dtype, m, n, k, silu_mul, bias, tile):
    torch.manual_seed(0)
    # W before x: the kernel just before a product must not write W (it reads W before its PDL wait)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(m, 2 * k if silu_mul else k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    # fp32 sums in a different order: one rounding of the output, a little more for long K in fp32
    assert_close(skinny_gemm_triton(x, weight, b, silu_mul, tile=tile), skinny_gemm_ref(x, weight, b, silu_mul),
                 scale=2)


def test_fp32_output_and_strided_rows(device):
    torch.manual_seed(1)
    wide = torch.randn(4, 80, device=device)
    x = wide[:, :48]  # row stride 80
    weight = torch.randn(21, 48, device=device)
    got = skinny_gemm_triton(x, weight, out_dtype=torch.float32)
    torch.testing.assert_close(got, skinny_gemm_ref(x, weight, out_dtype=torch.float32), atol=1e-4, rtol=1e-5)
    weight16 = weight.to(torch.float16)  # (not the kernel just before the product: see skinny_gemm's docstring)
    got16 = skinny_gemm_triton(x.to(torch.float16), weight16, out_dtype=torch.float32)
    assert got16.dtype == torch.float32  # an LM head's fp32 logits from 16-bit weights


def test_no_rows(device):
    weight = torch.randn(5, 16, device=device)
    assert skinny_gemm_triton(weight[:0], weight).shape == (0, 5)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_normed_skinny_gemm(device, assert_close, dtype, m, n, k, residual, tile):
    """add_rmsnorm (or rmsnorm) applied as the product reads x: the product and x + residual."""
    torch.manual_seed(2)
    x = torch.randn(m, k, dtype=dtype, device=device) * 3
    res = torch.randn(m, k, dtype=dtype, device=device) if residual else None
    norm_weight = (torch.rand(k, device=device) + 0.5).to(dtype)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    bias = torch.randn(n, dtype=dtype, device=device)
    got, got_res = normed_skinny_gemm_triton(x, res, norm_weight, 1e-6, weight, bias, tile=tile)
    want, want_res = normed_skinny_gemm_ref(x, res, norm_weight, 1e-6, weight, bias)
    assert torch.equal(got_res, want_res)  # the same one rounding of x + residual
    if residual:
        assert got_res.data_ptr() not in (x.data_ptr(), res.data_ptr())
    else:
        assert got_res is x
    # the normalised row may round the other way in a few places: a little more than one rounding
    assert_close(got, want, scale=3)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_normed_product_of_an_fp32_sum(device, assert_close, dtype, tile):
    """x an fp32 sum (the one-row MLP's, layers/one_row_mlp.py): rounded to the residual's dtype before
    the add, as the 16-bit product it stands for would be; the output and x + residual in that dtype."""
    torch.manual_seed(4)
    x = torch.randn(1, 96, device=device) * 3
    res = torch.randn(1, 96, dtype=dtype, device=device)
    norm_weight = (torch.rand(96, device=device) + 0.5).to(dtype)
    weight = torch.randn(37, 96, dtype=dtype, device=device) / 96**0.5
    got, got_res = normed_skinny_gemm_triton(x, res, norm_weight, 1e-6, weight, tile=tile)
    want, want_res = normed_skinny_gemm_triton(x.to(dtype), res, norm_weight, 1e-6, weight, tile=tile)
    assert got.dtype == got_res.dtype == dtype
    assert torch.equal(got_res, want_res) and torch.equal(got, want)
    ref, ref_res = normed_skinny_gemm_ref(x, res, norm_weight, 1e-6, weight)
    assert torch.equal(ref_res, want_res)
    assert_close(ref, want, scale=3)


@pytest.mark.parametrize("prefetch_two", [False, True])
@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("mode", ["plain", "silu_mul", "norm"])
@pytest.mark.parametrize("k", [64, 96, 128, 700])  # one chunk (no second), a partial second, exactly two, many
def test_chunks_before_the_wait(device, assert_close, monkeypatch, k, mode, defer, prefetch_two):
    """One or two chunks of W read before the PDL wait: each chunk counts once."""
    monkeypatch.setattr(skinny, "PREFETCH_MAX_PROGRAMS", 1 << 30 if prefetch_two else 0)
    assert skinny.prefetched_chunks(3, k, 64) == (2 if prefetch_two and k > 64 else 1)
    torch.manual_seed(3)
    tile, dtype = (4, 64, 4, 1, defer), torch.bfloat16
    weight = torch.randn(11, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(1, 2 * k if mode == "silu_mul" else k, dtype=dtype, device=device)
    if mode == "norm":
        norm_weight = (torch.rand(k, device=device) + 0.5).to(dtype)
        got = normed_skinny_gemm_triton(x, None, norm_weight, 1e-6, weight, tile=tile)[0]
        want = normed_skinny_gemm_ref(x, None, norm_weight, 1e-6, weight)[0]
    else:
        got = skinny_gemm_triton(x, weight, silu_mul=mode == "silu_mul", tile=tile)
        want = skinny_gemm_ref(x, weight, silu_mul=mode == "silu_mul")
    assert_close(got, want, scale=2)


def test_writes_into_out(device, assert_close):
    """out (the tensor-parallel all-reduce's buffer, TensorParallel.reduce_buffer) gets the product in place."""
    torch.manual_seed(2)
    x = torch.randn(1, 64, device=device)
    weight = torch.randn(24, 64, device=device)
    out = torch.full((1, 24), float("nan"), device=device)
    got = skinny_gemm_triton(x, weight, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, skinny_gemm_ref(x, weight))
    with pytest.raises(AssertionError):  # the wrong shape is refused, not written past
        skinny_gemm_triton(x, weight, out=torch.empty(1, 23, device=device))


# One row through TMA (_tma_row_kernel): N not a multiple of BLOCK_N, K not a multiple of BLOCK_K (rows
# and columns past W read as zeros), K = 712 (16-bit rows of 1,424 bytes: a multiple of 16, as a
# descriptor needs); qwen2.5-0.5b's gate/up and llama-3.2-1b's down on the GPU.
TMA_SHAPES = [(8, 64), (37, 96), (19, 712)] + [
    pytest.param(n, k, marks=pytest.mark.gpu) for n, k in [(9728, 896), (2048, 8192)]
]
# (BLOCK_N, BLOCK_K, warps, stages): several chunks in flight, and a lone chunk past K's end
TMA_TILES = [None, (8, 32, 4, 3), (4, 64, 4, 2)]


@pytest.mark.parametrize("tile", TMA_TILES)
@pytest.mark.parametrize("silu_mul,bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", TMA_SHAPES)
def test_tma_row(device, assert_close, dtype, n, k, silu_mul, bias, tile):
    torch.manual_seed(4)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(1, 2 * k if silu_mul else k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    got = skinny_gemm_triton(x, weight, b, silu_mul, tile=tile or skinny.tma_tile(n, k))
    assert_close(got, skinny_gemm_ref(x, weight, b, silu_mul), scale=2)


def test_tma_choice(monkeypatch):
    """Which one-row products read W through TMA: large weights with rows of at most TMA_MAX_K that a
    descriptor can take, on a GPU that has it."""
    monkeypatch.setattr(skinny, "tma_supported", lambda device: True)
    k = skinny.TMA_MAX_K
    row, rows = torch.empty(1, k), torch.empty(2, k)
    big = torch.empty(skinny.TMA_MIN_WEIGHT // k, k)
    assert skinny.uses_tma(row, big)
    assert not skinny.uses_tma(rows, big)  # one row only
    assert not skinny.uses_tma(row, big[:-1])  # under TMA_MIN_WEIGHT
    assert not skinny.uses_tma(torch.empty(1, 2 * k), torch.empty(big.shape[0], 2 * k))  # longer rows
    odd = torch.empty(skinny.TMA_MIN_WEIGHT // 700 + 1, 700, dtype=torch.float16)  # 1,400-byte rows
    assert not skinny.tma_ok(odd) and not skinny.uses_tma(torch.empty(1, 700, dtype=torch.float16), odd)
    assert not skinny.tma_ok(torch.empty(8, 72, dtype=torch.bfloat16)[:, 4:])  # base 8 bytes off
    monkeypatch.undo()
    assert not skinny.tma_supported(torch.device("cpu"))


def test_tma_by_default_but_not_with_a_norm(device, assert_close, monkeypatch):
    """With no tile given, a product uses_tma picks goes through TMA; the same weight with a norm in the
    product keeps plain loads (the layers run the norm kernel first: layernorm.normed_product)."""
    monkeypatch.setattr(skinny, "tma_supported", lambda device: True)
    monkeypatch.setattr(skinny, "TMA_MIN_WEIGHT", 1)
    launches = []
    launch = skinny._launch_tma
    monkeypatch.setattr(skinny, "_launch_tma", lambda *args: launches.append(args[1].shape) or launch(*args))
    torch.manual_seed(5)
    x, weight = torch.randn(1, 96, device=device), torch.randn(37, 96, device=device) / 96**0.5
    assert_close(skinny_gemm_triton(x, weight), skinny_gemm_ref(x, weight), scale=2)
    assert launches == [(37, 96)]
    norm_weight = torch.rand(96, device=device) + 0.5
    got = normed_skinny_gemm_triton(x, None, norm_weight, 1e-6, weight)[0]
    assert_close(got, normed_skinny_gemm_ref(x, None, norm_weight, 1e-6, weight)[0], scale=3)
    assert launches == [(37, 96)]
