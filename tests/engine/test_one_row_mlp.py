"""The one-row MLP (layers/one_row_mlp.py) against the layer's separate kernels: two layers' MLPs, each
followed by the next layer's normed product (the first layer's qkv after the last layer's MLP, as the
next step's), three passes, so that each layer's sum is zeroed by the layer before it every time."""
import pytest
import torch

import batchgen.layers.one_row_mlp as one_row_mlp
from batchgen.layers.layernorm import RMSNorm, normed_product
from batchgen.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, SplitParts
from batchgen.layers.one_row_mlp import OneRowMLP, linked_one_row_mlps, one_row_mlps
from batchgen.models.llama import LlamaMLP

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # (tests/conftest.py skips gpu without CUDA)
H, I = 64, 96


class Layer:
    def __init__(self, dtype, device, gen):
        def rand(*shape, scale):
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

        self.mlp = LlamaMLP.__new__(LlamaMLP)  # (the two products only: what OneRowMLP reads)
        torch.nn.Module.__init__(self.mlp)
        self.mlp.gate_up_proj = MergedColumnParallelLinear(H, [I, I], False, gate_up=True).to(device, dtype)
        self.mlp.down_proj = RowParallelLinear(I, H, False).to(device, dtype)
        self.mlp.gate_up_proj.weight.data.copy_(rand(2 * I, H, scale=H**-0.5))
        self.mlp.down_proj.weight.data.copy_(rand(H, I, scale=I**-0.5))
        self.qkv = ColumnParallelLinear(H, 48, False).to(device, dtype)
        self.qkv.weight.data.copy_(rand(48, H, scale=H**-0.5))
        self.input_norm, self.post_norm = RMSNorm(H, 1e-6).to(device, dtype), RMSNorm(H, 1e-6).to(device, dtype)
        self.input_norm.weight.data.copy_(1 + rand(H, scale=0.1))
        self.post_norm.weight.data.copy_(1 + rand(H, scale=0.1))


@pytest.mark.parametrize("interrupted", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_mlp_gives_the_separate_kernels_result(device, dtype, interrupted):
    """interrupted: a first pass raised after the first layer's MLP (the last layer never zeroed the
    first one's sum): the passes after it are right all the same."""
    gen = torch.Generator().manual_seed(0)
    layers = [Layer(dtype, device, gen) for _ in range(2)]
    fused = linked_one_row_mlps([layer.mlp for layer in layers])
    assert fused[0].next is fused[1] and fused[1].next is fused[0]
    assert fused[0].first is fused[1].first is fused[0]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if interrupted:
        x = torch.randn(1, H, generator=gen).to(device=device, dtype=dtype)
        fused[0](layers[0].post_norm, x, x)
        assert fused[0].open and fused[0].sum.abs().sum() > 0
    for _ in range(3):  # passes: steps of the two layers
        attn_out = [torch.randn(1, H, generator=gen).to(device=device, dtype=dtype) for _ in layers]
        residual = torch.randn(1, H, generator=gen).to(device=device, dtype=dtype)
        ours, theirs = residual, residual
        for i, (layer, one_row) in enumerate(zip(layers, fused)):
            following = layers[(i + 1) % 2]
            assert OneRowMLP.takes(attn_out[i], ours)
            summed, ours = one_row(layer.post_norm, attn_out[i], ours)
            assert isinstance(summed, SplitParts) and summed.parts.dtype == torch.float32
            got, ours = normed_product(following.input_norm, summed, ours, following.qkv)

            gate_up, theirs = normed_product(layer.post_norm, attn_out[i], theirs, layer.mlp.gate_up_proj)
            down = layer.mlp.down_proj(gate_up, silu_mul=True, norm_follows=True)
            want, theirs = normed_product(following.input_norm, down, theirs, following.qkv)
            assert got.dtype == want.dtype == dtype
            torch.testing.assert_close(ours.float(), theirs.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(got.float(), want.float(), atol=2 * tol, rtol=2 * tol)
            ours = theirs  # (each layer from the same residual: differences do not build up)


def test_taken_only_on_one_gpu_with_two_layers_or_more(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    mlps = [Layer(torch.bfloat16, "cpu", gen).mlp for _ in range(2)]
    assert one_row_mlps(mlps, torch.device("cpu"), 1) is None  # a GPU's
    assert not OneRowMLP.takes(torch.zeros(2, H), torch.zeros(2, H))  # one row only
    assert not OneRowMLP.takes(torch.zeros(1, H), None)  # after an attention block: with its residual
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        gpu_mlps = [mlp.to(cuda) for mlp in mlps]
        assert one_row_mlps(gpu_mlps[:1], cuda, 1) is None and one_row_mlps(gpu_mlps, cuda, 2) is None
        monkeypatch.setattr(one_row_mlp, "MAX_GATE_UP", 2 * I * H - 1)
        assert one_row_mlps(gpu_mlps, cuda, 1) is None  # a gate/up larger than those it pays for
