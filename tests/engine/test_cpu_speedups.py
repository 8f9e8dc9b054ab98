"""The CPU-only paths: packed oneDNN weights give F.linear's products (and a tied LM head keeps the
embedding's plain weight), and the engine's glibc malloc tuning applies."""
import platform

import pytest
import torch
import torch.nn.functional as F

from batchgen.executor.cpu_memory import keep_freed_memory
from batchgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from batchgen.layers.linear import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.packed_linear import can_pack
from tests.engine.test_layer_products import make_layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "cls,bias", [(ColumnParallelLinear, True), (ColumnParallelLinear, False), (RowParallelLinear, True)]
)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_layers_compute_f_linear(dtype, cls, bias, rows):
    if not can_pack(dtype):
        pytest.skip(f"this torch/CPU cannot pack {dtype} weights")
    layer = make_layer(cls, 72, 40, bias, dtype, "cpu")
    weight = layer.weight.detach().clone()
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    want = F.linear(x, weight, layer.bias)
    layer.pack()
    assert layer.packed is not None and layer.weight.numel() == 0  # the plain copy is freed
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(layer(x), want, atol=tol, rtol=tol)


def test_tied_lm_head_keeps_the_embedding_weight():
    if not can_pack(torch.float32):
        pytest.skip("this torch/CPU cannot pack fp32 weights")
    embed, head = VocabParallelEmbedding(50, 16), ParallelLMHead(50, 16)
    embed.weight.data.copy_(torch.randn(50, 16))
    head.weight = embed.weight
    hidden, ids = torch.randn(3, 16), torch.tensor([0, 7, 49])
    want_logits, want_embedding = head(hidden), embed(ids)
    head.pack(keep_plain=True)
    assert head.packed is not None
    torch.testing.assert_close(head(hidden), want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(embed(ids), want_embedding)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_malloc_tuning_applies_on_glibc():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # once per process; later calls return the same
