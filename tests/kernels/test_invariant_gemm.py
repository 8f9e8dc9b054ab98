"""The batch-invariant product: close to the fp32 reference, and each row's bits the same whatever
rows share the launch (1 row, a decode batch, a prefill step: each takes another tile)."""
import pytest
import torch

from batchgen.kernels.invariant_gemm import (
    BLOCK_K,
    invariant_gemm_ref,
    invariant_gemm_triton,
    pick_tile,
    split_of,
)

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
def test_rows_do_not_depend_on_the_batch(device, dtype, split):
    """Three probe rows alone, and at other places among other rows of every batch size: the same bits."""
    n, k = (96, 256) if device == "cpu" else (2048, 2048)
    torch.manual_seed(2)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    probe = torch.randn(3, k, dtype=dtype, device=device)
    alone = invariant_gemm_triton(probe, w, split=split)
    rows = [3, 64, 65, 513] if device == "cpu" else [3, 64, 65, 256, 513, 2048, 8192]
    assert len({pick_tile(m) for m in rows}) == 3  # every tile takes part
    for m in rows:
        batch = torch.randn(m, k, dtype=dtype, device=device) * 3
        at = torch.randperm(m, device=device)[:3]
        batch[at] = probe
        got = invariant_gemm_triton(batch, w, split=split)
        assert torch.equal(got[..., at, :], alone), f"{m} rows changed a probe row's bits"


def test_split_is_the_weights_alone():
    """One row's product spreads over ~128 programs; the split never depends on rows (it has none)."""
    assert split_of(2048, 8192) == 2  # llama-3.2-1b's down: 64 column tiles
    assert split_of(4096, 14336) == 1  # llama-3.1-8b's: 128 already
    assert split_of(896, 4864) == 4  # qwen2.5-0.5b's: 28
    assert split_of(896, 896) == 2  # K allows two whole halves only
    assert split_of(40, 100) == 1  # K not a whole number of BLOCK_K steps
