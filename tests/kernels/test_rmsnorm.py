import pytest
import torch

from batchgen.kernels.rmsnorm import add_rmsnorm_ref, add_rmsnorm_triton, rmsnorm_ref, rmsnorm_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, hidden): one token, primes, hidden not a power of 2; llama-3.2-1b / 3.1-8b on the GPU.
SHAPES = [(1, 8), (7, 33), (5, 128)] + [
    pytest.param(t, h, marks=pytest.mark.gpu) for t, h in [(257, 2048), (3, 4096), (1031, 5120)]
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rmsnorm(device, assert_close, dtype, tokens, hidden, eps):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device) * 3
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    assert_close(rmsnorm_triton(x, weight, eps), rmsnorm_ref(x, weight, eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_add_rmsnorm(device, assert_close, dtype, tokens, hidden):
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn(tokens, hidden, dtype=dtype, device=device) * 4
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = add_rmsnorm_triton(x, residual, weight, 1e-6)
    ref_out, ref_residual = add_rmsnorm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert_close(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_strided_rows_and_fp32_weight(device, assert_close):
    torch.manual_seed(2)
    wide = torch.randn(9, 100, dtype=torch.float16, device=device)
    x = wide[:, 3:70]  # row stride 100, not 67
    weight = torch.rand(67, dtype=torch.float32, device=device)
    out = rmsnorm_triton(x, weight, 1e-5)
    assert out.dtype == torch.float32  # as the reference: fp32 weight * fp16 row
    assert_close(out, rmsnorm_ref(x, weight, 1e-5))


def test_no_tokens(device):
    x = torch.randn(0, 16, device=device)
    weight = torch.ones(16, device=device)
    assert rmsnorm_triton(x, weight, 1e-5).shape == (0, 16)
    out, res = add_rmsnorm_triton(x, x, weight, 1e-5)
    assert out.shape == res.shape == (0, 16)
