"""On a GPU: the fused MoE at the shapes of qwen3-30b-a3b (also its TP=2 shard) and mixtral-8x7b
against its reference with the block sizes pick_config gives, in bf16 and with FP8 experts (per channel
and in 128x128 blocks), both aligns (the Triton kernels, the torch ops) at real sizes, and the router +
fused MoE captured in a CUDA graph and replayed on new inputs."""
import pytest
import torch

from batchgen.kernels.fused_moe import (
    fused_moe,
    fused_moe_reference,
    fused_moe_triton,
    quantize_experts,
)
from batchgen.kernels.moe_align import TRITON_MAX_PAIRS, moe_align_torch, moe_align_triton
from batchgen.kernels.moe_config import pick_config
from batchgen.kernels.moe_router import select_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
QWEN3_TP2 = dict(QWEN3, inter=384)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, inter=14336)
TINY = dict(num_experts=4, top_k=2, hidden=64, inter=48)  # (a tiny test model's, in fp32)
# the products sum in another order than the reference
TOLERANCE = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def layer(num_experts, top_k, hidden, inter, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device="cuda") / inter**0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("shape,num_tokens,dtype", [(QWEN3, t, torch.bfloat16) for t in (1, 16, 256, 2048)]
                         + [(QWEN3_TP2, 64, torch.bfloat16), (QWEN3, 16, torch.float32), (TINY, 3, torch.float32)]
                         + [(MIXTRAL, t, torch.bfloat16) for t in (1, 64)])
def test_model_shapes(shape, num_tokens, dtype):
    """pick_config's tiles (fp32: half the K step) against the reference."""
    w13, w2 = layer(**shape, dtype=dtype)
    torch.manual_seed(1)
    x = torch.randn(num_tokens, shape["hidden"], device="cuda", dtype=dtype)
    weights, ids = select_experts(torch.randn(num_tokens, shape["num_experts"], device="cuda"), shape["top_k"], True)
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe_reference(x, w13, w2, weights, ids), **TOLERANCE[dtype])


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("shape,num_tokens", [(QWEN3, t) for t in (1, 256, 2048)] + [(QWEN3_TP2, 64), (MIXTRAL, 64)])
def test_fp8_experts(shape, num_tokens, block):
    """FP8 experts against the reference's fp32 math on the dequantized weights with the inputs rounded alike:
    bf16 outputs, and a value of h may round one e4m3 step apart where its bf16 sum lands on a boundary."""
    w13, w2, fp8 = quantize_experts(*layer(**shape), block)
    torch.manual_seed(1)
    x = torch.randn(num_tokens, shape["hidden"], device="cuda", dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(num_tokens, shape["num_experts"], device="cuda"), shape["top_k"], True)
    got = fused_moe(x, w13, w2, weights, ids, fp8).float()
    want = fused_moe_reference(x, w13, w2, weights, ids, fp8).float()
    err = (got - want).abs()
    assert err.mean() < 0.01 * want.abs().mean() and (err > 0.05 * want.abs().max()).float().mean() < 1e-3


def test_batch_invariant():
    """With the same config, a token's output is the same bits alone and among other tokens (no
    atomics; a row's sums do not depend on the other rows of its block)."""
    w13, w2 = layer(**QWEN3)
    torch.manual_seed(5)
    x = torch.randn(64, QWEN3["hidden"], device="cuda", dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(64, QWEN3["num_experts"], device="cuda"), QWEN3["top_k"], True)
    config = pick_config(64, QWEN3["hidden"], QWEN3["inter"], QWEN3["num_experts"], QWEN3["top_k"], x.device)
    batch = fused_moe_triton(x, w13, w2, weights, ids, config)
    for t in (0, 37):
        alone = fused_moe_triton(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], config)
        assert torch.equal(alone[0], batch[t])


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(256, 128, 8, 16), (1024, 128, 8, 64),
                                                                   (3072, 128, 8, 16), (4096, 8, 2, 128),
                                                                   (300, 60, 4, 32)])
def test_aligns_agree(num_tokens, num_experts, top_k, block_m):
    torch.manual_seed(2)
    ids = torch.randn(num_tokens, num_experts, device="cuda").topk(top_k, dim=-1).indices.int()
    assert num_tokens * top_k <= TRITON_MAX_PAIRS
    triton_ids, triton_blocks, triton_padded = moe_align_triton(ids, num_experts, block_m)
    torch_ids, torch_blocks, torch_padded = moe_align_torch(ids, num_experts, block_m)
    used = int(torch_padded)
    assert torch.equal(triton_padded, torch_padded) and torch.equal(triton_blocks, torch_blocks)
    assert torch.equal(triton_ids[:used], torch_ids[:used])


@pytest.mark.parametrize("fp8", [None, "block"])
@pytest.mark.parametrize("num_tokens", [4, 256, 4096])  # (4096 * 8 pairs: the torch align)
def test_cuda_graph_replay(num_tokens, fp8):
    """Router, align, the inputs' rounding and the products captured once, replayed on other tokens and
    logits: nothing in the layer depends on values read back to the host."""
    w13, w2 = layer(**QWEN3)
    if fp8:
        w13, w2, fp8 = quantize_experts(w13, w2, block=True)
    x = torch.zeros(num_tokens, QWEN3["hidden"], device="cuda", dtype=torch.bfloat16)
    logits = torch.zeros(num_tokens, QWEN3["num_experts"], device="cuda")

    def step():
        weights, ids = select_experts(logits, QWEN3["top_k"], True)
        return fused_moe(x, w13, w2, weights, ids, fp8)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (compiles and allocator warm-up outside the capture)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (3, 4):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits) * 2)
        graph.replay()
        weights, ids = select_experts(logits, QWEN3["top_k"], True)
        want = fused_moe_reference(x, w13, w2, weights, ids, fp8)
        if fp8:  # (test_fp8_experts's measure: a value of h may round one e4m3 step apart)
            err = (out.float() - want.float()).abs()
            assert err.mean() < 0.01 * want.float().abs().mean()
        else:
            torch.testing.assert_close(out, want, **TOLERANCE[torch.bfloat16])
