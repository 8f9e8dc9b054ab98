import pytest
import torch

from batchgen.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, I): one token, primes, I over one block of 1024; llama-3.2-1b / 3.1-8b on the GPU.
SHAPES = [(1, 1), (7, 37), (3, 1500)] + [
    pytest.param(t, i, marks=pytest.mark.gpu) for t, i in [(257, 8192), (1, 14336), (4099, 14336)]
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", SHAPES)
def test_silu_and_mul(device, assert_close, dtype, tokens, inter):
    torch.manual_seed(0)
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device) * 4
    # The reference rounds silu(gate) before the product: allow two roundings.
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), scale=2)


def test_strided_rows(device, assert_close):
    torch.manual_seed(1)
    wide = torch.randn(5, 64, device=device)
    x = wide[:, :42]  # row stride 64
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x))


def test_fp32_against_formula(device):
    x = torch.linspace(-30, 30, 2 * 301, dtype=torch.float64, device=device).view(1, -1)
    gate, up = x.chunk(2, dim=-1)
    expected = (gate / (1 + torch.exp(-gate)) * up).float()
    torch.testing.assert_close(silu_and_mul_triton(x.float()), expected, atol=1e-5, rtol=1e-5)
