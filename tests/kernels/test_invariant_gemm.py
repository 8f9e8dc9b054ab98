"""The batch-invariant product: close to the fp32 reference, and each row's bits the same whatever
rows share the launch (1 row, a decode batch, a prefill step: each takes another tile)."""
import pytest
import torch

from batchgen.kernels.invariant_gemm import (
    BLOCK_K,
    PARTS_MAX_ROWS,
    invariant_gemm_ref,
    invariant_gemm_triton,
    pick_tile,
    split_of,
    takes_tma,
    tma_tile,
)
from batchgen.kernels.silu_and_mul import silu_and_mul_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, N, K): one row, K not a multiple of BLOCK_K, each tile of pick_tile; llama shapes on the GPU
SHAPES = [(1, 40, 64), (5, 33, 100), (70, 96, 128), (520, 48, 64)] + [
    pytest.param(m, n, k, marks=pytest.mark.gpu) for m, n, k in [(1, 3072, 2048), (256, 2048, 8192),
                                                                  (4100, 4096, 4096)]
]
# rows each probe batch holds: pick_tile's three tiles (and on the GPU a whole prefill step)
BATCH_ROWS = [3, 64, 65, 513] + [pytest.param(m, marks=pytest.mark.gpu) for m in (256, 2048, 8192)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(device, assert_close, dtype, m, n, k, bias):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    assert_close(invariant_gemm_triton(x, w, b), invariant_gemm_ref(x, w, b), scale=2)
    got = invariant_gemm_triton(x, w, b, out_dtype=torch.float32)
    torch.testing.assert_close(got, invariant_gemm_ref(x, w, b, out_dtype=torch.float32),
                               atol=1e-2 if dtype != torch.float32 else 1e-4, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 4])
def test_split_parts_sum_to_the_product(device, dtype, split):
    torch.manual_seed(1)
    x = torch.randn(6, 4 * BLOCK_K, dtype=dtype, device=device)
    w = torch.randn(24, 4 * BLOCK_K, dtype=dtype, device=device)
    parts = invariant_gemm_triton(x, w, split=split)
    assert parts.shape == (split, 6, 24) and parts.dtype == torch.float32
    torch.testing.assert_close(parts, invariant_gemm_ref(x, w, split=split), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(parts.sum(0), x.float() @ w.float().t(), atol=1e-3, rtol=1e-3)


def as_product(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The product as the layer after it sees it: split-K parts summed in order in fp32 and rounded once
    (as rmsnorm.add_rmsnorm_parts does), or the product itself."""
    if y.dim() == 2:
        return y
    total = y[0]
    for part in y[1:]:
        total = total + part
    return total.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("silu_mul_out", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_rows_do_not_depend_on_the_batch(device, dtype, split, silu_mul_out):
    """Three probe rows alone, and at other places among other rows of every batch size: the same bits
    (on the TMA path a split product of more than PARTS_MAX_ROWS rows sums its slices itself)."""
    if silu_mul_out and (split > 1 or dtype == torch.float32):
        pytest.skip("gate/up: 16-bit, never split")
    n, k = (96, 256) if device == "cpu" else (2048, 2048)
    torch.manual_seed(2)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    probe = torch.randn(3, k, dtype=dtype, device=device)
    alone = as_product(invariant_gemm_triton(probe, w, split=split, silu_mul_out=silu_mul_out), dtype)
    rows = [3, 64, 65, 513] if device == "cpu" else [3, 64, 65, 256, 513, 2048, 8192]
    tma = takes_tma(w)
    tiles = {tma_tile(m, silu_mul_out, split) if tma else pick_tile(m) for m in rows}
    assert len(tiles) >= 3  # every tile takes part (the TMA path's too)
    assert not tma or split == 1 or any(m > PARTS_MAX_ROWS for m in rows)
    for m in rows:
        batch = torch.randn(m, k, dtype=dtype, device=device) * 3
        at = torch.randperm(m, device=device)[:3]
        batch[at] = probe
        got = as_product(invariant_gemm_triton(batch, w, split=split, silu_mul_out=silu_mul_out), dtype)
        assert torch.equal(got[at], alone), f"{m} rows changed a probe row's bits"
    if silu_mul_out:
        assert tma and alone.shape == (3, n // 2)
        torch.testing.assert_close(alone.float(), silu_and_mul_ref(invariant_gemm_ref(probe, w)).float(),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tma_path_sums_slices_as_the_parts_do(device, dtype):
    """Past PARTS_MAX_ROWS a split product returns one part, the fp32 sum of the slices, equal to the
    in-order sum of the parts of the same rows taken PARTS_MAX_ROWS at a time."""
    torch.manual_seed(3)
    m, n, k = 3 * PARTS_MAX_ROWS + 5, 2048, 8192
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    assert takes_tma(w)
    whole = invariant_gemm_triton(x, w, split=2)
    assert whole.shape == (1, m, n) and whole.dtype == torch.float32
    pieces = [invariant_gemm_triton(x[i : i + PARTS_MAX_ROWS], w, split=2) for i in range(0, m, PARTS_MAX_ROWS)]
    assert all(p.shape[0] == 2 for p in pieces)
    assert torch.equal(torch.cat([p[0] + p[1] for p in pieces]), whole[0])


@pytest.mark.parametrize("split", [1, 2])
def test_rows_after_the_add_and_norm_do_not_depend_on_the_batch(device, split):
    """A product and the add + RMSNorm after it, as a decoder layer runs them (parts to the parts' norm,
    a plain product to the plain one): a probe row's normalised output and residual alone and inside
    batches of every tile, the same bits."""
    from batchgen.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_parts

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, k = (96, 256) if device == "cpu" else (2048, 2048)
    torch.manual_seed(4)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    norm_w = torch.rand(n, dtype=dtype, device=device) + 0.5
    probe, probe_res = torch.randn(3, k, dtype=dtype, device=device), torch.randn(3, n, dtype=dtype, device=device)

    def layer(x, res):
        y = invariant_gemm_triton(x, w, split=split)
        return add_rmsnorm_parts(y, res, norm_w, 1e-5) if y.dim() == 3 else add_rmsnorm(y, res, norm_w, 1e-5)

    alone = layer(probe, probe_res)
    for m in ([3, 64, 65, 513] if device == "cpu" else [3, 64, 65, 256, 513, 2048, 8192]):
        x, res = torch.randn(m, k, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
        at = torch.randperm(m, device=device)[:3]
        x[at], res[at] = probe, probe_res
        normed, residual = layer(x, res)
        assert torch.equal(normed[at], alone[0]) and torch.equal(residual[at], alone[1]), f"{m} rows"


def test_split_is_the_weights_alone():
    """One row's product spreads over ~128 programs; the split never depends on rows (it has none)."""
    assert split_of(2048, 8192) == 2  # llama-3.2-1b's down: 64 column tiles
    assert split_of(4096, 14336) == 1  # llama-3.1-8b's: 128 already
    assert split_of(896, 4864) == 4  # qwen2.5-0.5b's: 28
    assert split_of(896, 896) == 2  # K allows two whole halves only
    assert split_of(40, 100) == 1  # K not a whole number of BLOCK_K steps
