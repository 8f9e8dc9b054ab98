import pytest
import torch

from batchgen.kernels.decode_mlp import decode_mlp, decode_mlp_ref, decode_mlp_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (H, I): I not a multiple of BLOCK_J (the last program re-reads a row and drops it); llama-3.2-1b and
# qwen2.5-0.5b (H = 896 = 7 * 128) on the GPU
SHAPES = [(64, 40), (128, 96)] + [
    pytest.param(h, i, marks=pytest.mark.gpu) for h, i in [(2048, 8192), (896, 4864)]
]
# (BLOCK_J, BLOCK_K, BLOCK_H, warps): the shape's default, small chunks (several a row), one chunk a row
TILES = [None, (16, 32, 16, 4), (8, 64, 64, 2)]


def _inputs(h, i, dtype, device, x_dtype=None):
    gen = torch.Generator().manual_seed(h + i)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    # the weights first: the kernel reads its first chunks before its PDL wait
    w_gate_up = randn(2 * i, h, scale=h**-0.5).to(dtype)
    w_down_t = randn(i, h, scale=i**-0.5).to(dtype)  # the down projection's weight, transposed
    norm_weight = (1 + randn(h, scale=0.1)).to(dtype)
    x = randn(1, h).to(x_dtype or dtype)
    residual = randn(1, h).to(dtype)
    return x, residual, norm_weight, w_gate_up, w_down_t


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,i", SHAPES)
def test_decode_mlp(device, dtype, h, i, tile):
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(h, i, dtype, device)
    out_sum = torch.zeros(1, h, device=device)
    next_sum = torch.full((1, h), 7.0, device=device)
    new_residual = decode_mlp_triton(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t, out_sum, next_sum, tile)
    want_sum, want_residual = decode_mlp_ref(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t)
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(next_sum, torch.zeros_like(next_sum))  # the next layer's sum, zeroed
    # the kernel's g and u are fp32 sums in another order, each rounded once to dtype: where a
    # rounding differs by one unit, the sum moves by that unit times a row of W_down
    atol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out_sum, want_sum, atol=atol, rtol=atol)


def test_fp32_input_is_rounded_first(device):
    """x may be an fp32 sum (an earlier decode MLP's): it is added to the residual as the model's dtype."""
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(64, 40, torch.float16, device, x_dtype=torch.float32)
    out_sum = torch.zeros(1, 64, device=device)
    next_sum = torch.zeros(1, 64, device=device)
    new_residual = decode_mlp_triton(x, residual, norm_weight, 1e-6, w_gate_up, w_down_t, out_sum, next_sum)
    assert torch.equal(new_residual, x.to(torch.float16) + residual)
    torch.testing.assert_close(out_sum, decode_mlp_ref(x, residual, norm_weight, 1e-6, w_gate_up, w_down_t)[0],
                               atol=4e-3, rtol=4e-3)


def test_adds_to_the_sum(device):
    """The programs add into out_sum: on a non-zero sum the product lands on top of it."""
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(64, 40, torch.float32, device)
    out_sum = torch.full((1, 64), 0.5, device=device)
    decode_mlp_triton(x, residual, norm_weight, 1e-6, w_gate_up, w_down_t, out_sum, torch.zeros(1, 64, device=device))
    want = decode_mlp_ref(x, residual, norm_weight, 1e-6, w_gate_up, w_down_t)[0] + 0.5
    torch.testing.assert_close(out_sum, want, atol=1e-4, rtol=1e-4)


def test_cpu_path_keeps_the_contract():
    """decode_mlp off the GPU: the reference's sum added to out_sum, next_sum zeroed, x + residual."""
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(64, 40, torch.float32, "cpu")
    out_sum = torch.full((1, 64), 0.25)
    next_sum = torch.ones(1, 64)
    new_residual = decode_mlp(x, residual, norm_weight, 1e-6, w_gate_up, w_down_t, out_sum, next_sum)
    want_sum, want_residual = decode_mlp_ref(x, residual, norm_weight, 1e-6, w_gate_up, w_down_t)
    assert torch.equal(new_residual, want_residual) and not next_sum.any()
    torch.testing.assert_close(out_sum, want_sum + 0.25)
