"""Every layer's product goes through PackableWeight.matmul: one row of 16-bit activations on a GPU
goes to the skinny kernel, anything else to F.linear (or the packed CPU weight); all give F.linear's
values. A down projection given the gate/up pair (silu_mul) gives the product of silu(gate) * up."""
import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels.silu_and_mul import silu_and_mul_ref
from batchgen.layers.embedding import ParallelLMHead
from batchgen.layers.layernorm import RMSNorm, normed_product
from batchgen.layers.linear import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.packed_linear import can_pack, streams_weight

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # (tests/conftest.py skips gpu without CUDA)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def make_layer(cls, in_features, out_features, bias, dtype, device):
    """A linear layer with seeded random weights (scaled by 1 / sqrt(in)) and bias."""
    gen = torch.Generator().manual_seed(1)
    layer = cls(in_features, out_features, bias=bias)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) / in_features**0.5)
    if bias:
        layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    return layer.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cls,bias", [(ColumnParallelLinear, True), (RowParallelLinear, False)])
def test_products_give_f_linear(device, dtype, rows, cls, bias):
    layer = make_layer(cls, 200, 72, bias, dtype, device)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    assert streams_weight(x) == (device == "cuda" and rows == 1 and dtype == torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    torch.testing.assert_close(layer(x).float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_down_projection_takes_the_gate_up_pair(device, dtype, rows, packed):
    if packed and (device != "cpu" or not can_pack(dtype)):
        pytest.skip("packing is for CPU weights this torch can pack")
    down = make_layer(RowParallelLinear, 96, 40, False, dtype, device)
    gate_up = torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype) * 3
    want = F.linear(silu_and_mul_ref(gate_up.float()), down.weight.float())
    if packed:
        down.pack()
    torch.testing.assert_close(down(gate_up, silu_mul=True).float(), want, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_lm_head_gives_fp32_logits_at_one_row_and_many(rows):
    head = ParallelLMHead(1000, 64)
    head.weight.data.copy_(torch.randn(head.weight.shape) / 8)
    head = head.to(device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
    torch.testing.assert_close(logits, hidden.float() @ head.weight.float().t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
def test_normed_product_gives_the_norm_then_the_product(device, rows, with_residual):
    """A decoder layer's norm -> qkv (or gate/up): one launch at one row on a GPU, the same values."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(200, 1e-5)
    norm.weight.data.copy_(torch.rand(200, generator=gen) + 0.5)
    norm = norm.to(device=device, dtype=dtype)
    qkv = make_layer(ColumnParallelLinear, 200, 72, True, dtype, device)
    x = (torch.randn(rows, 200, generator=gen) * 2).to(device=device, dtype=dtype)
    residual = torch.randn(rows, 200, generator=gen).to(device=device, dtype=dtype) if with_residual else None
    if residual is None:
        want_residual, normed = x, norm(x)
    else:
        normed, want_residual = norm(x, residual)
    want = qkv(normed)
    got, got_residual = normed_product(norm, x, residual, qkv)
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=3 * TOL[dtype], rtol=3 * TOL[dtype])
