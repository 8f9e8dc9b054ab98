import pytest
import torch

import batchgen.kernels.tile_gemm as tile_gemm_module
import batchgen.layers.packed_linear as packed_linear
from batchgen.kernels.rmsnorm import add_rmsnorm_parts_ref, add_rmsnorm_parts_triton, add_rmsnorm_ref
from batchgen.kernels.tile_gemm import candidate_tiles, pick_tile, tile_gemm_ref, tile_gemm_triton, uses_tile_gemm
from batchgen.layers.layernorm import RMSNorm
from batchgen.layers.linear import MergedColumnParallelLinear, RowParallelLinear, SplitParts

DTYPES = [torch.float16, torch.bfloat16]
# (M, N, K, tile (BM, BN, BK, stages, warps, SPLIT)): rows past BM, N past BN, K split in 2 and 4, a
# 16-row tile; on the GPU llama-3.2-1b's o and down at pick_tile's tiles (None; parts), the engine's at
# up to 64 rows and the swept 128-row tiles above that.
CASES = [(3, 96, 128, (64, 32, 64, 2, 4, 1)), (70, 80, 256, (64, 32, 64, 2, 4, 2)),
         (17, 64, 512, (16, 32, 64, 3, 4, 4))] + [
    pytest.param(m, n, k, None, marks=pytest.mark.gpu)
    for m, n, k in [(2, 2048, 2048), (100, 2048, 2048), (5, 2048, 8192), (64, 2048, 8192), (128, 2048, 8192)]
] + [  # the candidates start-up timing tries at 65-256 rows (two M tiles at 192 and 256)
    pytest.param(m, n, k, tile, marks=pytest.mark.gpu)
    for m, n, k in [(80, 2048, 8192), (192, 2048, 8192), (256, 2048, 2048)]
    for tile in candidate_tiles(m, n, k, False)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_tile_gemm(device, assert_close, dtype, m, n, k, tile):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, device=device)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    split = (tile or pick_tile(m, n, k, False, parts_ok=True))[-1]
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # every element must be written
    got = tile_gemm_triton(x, weight, parts_ok=True, tile=tile, out=out)
    if split > 1:  # fp32 parts, one per slice of K
        assert got.shape == (split, m, n) and got.dtype == torch.float32
        k_part = k // split
        want = torch.stack([x[:, s * k_part:(s + 1) * k_part].float()
                                @ weight[:, s * k_part:(s + 1) * k_part].float().t()
                            for s in range(split)])
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)  # fp32 sums of 16-bit products
    else:
        assert got is out
        assert_close(got, tile_gemm_ref(x, weight))  # fp32 sums in another order: one rounding of the output


@pytest.mark.parametrize("dtype", DTYPES)
# (M, I, K, tile): I a multiple of BN, and not (the last tile's gate columns past I, masked)
@pytest.mark.parametrize("m,inter,k,tile", [(5, 64, 128, (64, 32, 64, 2, 4, 1)), (40, 48, 64, (32, 16, 64, 1, 4, 1)),
                                            (5, 40, 128, (64, 16, 64, 2, 4, 1))] + [
    pytest.param(m, 8192, 2048, None, marks=pytest.mark.gpu) for m in (2, 30, 64, 128)] + [
    pytest.param(m, 8192, 2048, tile, marks=pytest.mark.gpu)
    for m in (80, 192, 256) for tile in candidate_tiles(m, 8192, 2048, True)])
def test_tile_gemm_silu_mul_out(device, assert_close, dtype, m, inter, k, tile):
    """An MLP's gate/up [2I, K]: the product gives silu(gate) * up [M, I], gate and up each rounded
    as the product rounds them; the reference applies SiLU-and-mul after the product."""
    torch.manual_seed(1)
    x = torch.randn(m, k, dtype=dtype, device=device)
    weight = torch.randn(2 * inter, k, dtype=dtype, device=device) / k**0.5
    got = tile_gemm_triton(x, weight, silu_mul_out=True, tile=tile)
    assert got.shape == (m, inter)
    assert_close(got, tile_gemm_ref(x, weight, silu_mul_out=True), scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts,rows,hidden", [(2, 3, 48), (4, 5, 100), (4, 70, 2048)])  # (16 warps at 2048)
def test_add_rmsnorm_parts(device, assert_close, dtype, parts, rows, hidden):
    """The add + RMSNorm after a split product: the parts summed in fp32 in split order and rounded
    to the residual's dtype, then add_rmsnorm."""
    torch.manual_seed(3)
    x = torch.randn(parts, rows, hidden, device=device)
    residual = torch.randn(rows, hidden, dtype=dtype, device=device)
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    got, got_residual = add_rmsnorm_parts_triton(x, residual, weight, 1e-6)
    want, want_residual = add_rmsnorm_parts_ref(x, residual, weight, 1e-6)
    assert_close(got_residual, want_residual)
    assert_close(got, want)
    summed = add_rmsnorm_ref(x.sum(0).to(dtype), residual, weight, 1e-6)[1]
    assert_close(want_residual, summed)  # (the reference is the plain sum up to fp32 order)


def test_choice(monkeypatch):
    """Which products take the tile kernel (uses_tile_gemm's docstring): 2 to 64 rows of 16-bit
    products: gate/up with its SiLU-and-mul; o and down (N <= K) whose caller sums split-K parts and
    whose grid has MIN_PROGRAMS; never qkv or LM heads (N > K), fp32 or unaligned rows."""
    monkeypatch.setattr(tile_gemm_module, "tile_gemm_supported", lambda device: True)
    bf16 = dict(dtype=torch.bfloat16)
    rows = {m: torch.empty(m, 2048, **bf16) for m in (1, 2, 64, 65)}
    gate_up, o, qkv = torch.empty(16384, 2048, **bf16), torch.empty(2048, 2048, **bf16), torch.empty(3072, 2048, **bf16)
    assert [uses_tile_gemm(rows[m], gate_up, silu_mul_out=True) for m in (1, 2, 64, 65)] == [False, True, True, False]
    assert [uses_tile_gemm(rows[m], o, parts_ok=True) for m in (2, 64, 65)] == [True, True, False]
    assert not uses_tile_gemm(rows[2], o)  # the caller cannot sum parts: only gate/up goes unsplit
    assert uses_tile_gemm(torch.empty(64, 8192, **bf16), torch.empty(2048, 8192, **bf16), parts_ok=True)  # down
    # 28 programs
    assert not uses_tile_gemm(torch.empty(64, 4864, **bf16), torch.empty(896, 4864, **bf16), parts_ok=True)
    assert not uses_tile_gemm(rows[64], qkv, parts_ok=True)
    big_gate_up = torch.empty(2 * 14336, 4096, **bf16)  # llama-3.1-8b's: 224 programs, more than one wave
    assert not uses_tile_gemm(torch.empty(8, 4096, **bf16), big_gate_up, silu_mul_out=True)
    assert not uses_tile_gemm(rows[2].float(), o.float(), parts_ok=True)
    # rows 8 bytes off 16-byte alignment
    assert not uses_tile_gemm(torch.empty(2, 2056, **bf16)[:, 4:], o, parts_ok=True)
    assert not uses_tile_gemm(torch.empty(2, 2040, **bf16), torch.empty(64, 2040, **bf16), True)  # K not whole BK steps
    assert pick_tile(100, 2048, 8192, False, parts_ok=True)[-1] == 4 and pick_tile(2, 2048, 2048, False)[-1] == 1
    monkeypatch.undo()
    assert not tile_gemm_module.tile_gemm_supported(torch.device("cpu"))


@pytest.mark.parametrize("gate_up_tiled,down_tiled", [(False, False), (True, True), (False, True), (True, False)])
def test_mlp_through_the_tile_kernel(monkeypatch, gate_up_tiled, down_tiled):
    """gate/up (gate_up=True) hands down either the pair or silu(gate) * up, where its product applies
    it; down takes either, and hands its norm split-K parts where the product gives them: the MLP's
    output after the add + RMSNorm is the same, whichever of the two products the tile kernel takes
    (llama-3.1-8b's gate/up stays with cuBLAS while its down takes the kernel)."""
    def tile_gemm(x, weight, silu_mul_out=False, parts_ok=False, tile=None, out=None):  # parts in two halves of K
        if silu_mul_out:
            return tile_gemm_module.tile_gemm_ref(x, weight, True)
        half = x.shape[1] // 2
        return torch.stack([x[:, :half] @ weight[:, :half].t(), x[:, half:] @ weight[:, half:].t()])
    some_tile = (16, 64, 128, 3, 4, 2)  # (the fake product above ignores it)
    monkeypatch.setattr(packed_linear, "tile_for", lambda x, weight, silu_mul_out=False, parts_ok=False:
                        some_tile if (gate_up_tiled if silu_mul_out else down_tiled) else None)
    monkeypatch.setattr(packed_linear, "tile_gemm", tile_gemm)
    torch.manual_seed(2)
    gate_up = MergedColumnParallelLinear(32, [48, 48], bias=False, gate_up=True)
    down = RowParallelLinear(48, 32, bias=False)
    norm = RMSNorm(32, 1e-6)
    for p in (gate_up.weight, down.weight, norm.weight):
        p.data.normal_(std=0.2)
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    mid = gate_up(x)
    assert mid.shape == ((3, 48) if gate_up_tiled else (3, 96))
    y = down(mid, silu_mul=True, norm_follows=True)
    assert isinstance(y, SplitParts) == down_tiled
    pair = x @ gate_up.weight.t()
    want = (torch.nn.functional.silu(pair[:, :48]) * pair[:, 48:]) @ down.weight.t()
    for got, expected in zip(norm(y, residual), norm(want, residual)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
