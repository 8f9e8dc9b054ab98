import pytest
import torch

from batchgen.kernels import pdl
from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.gumbel_argmax import gumbel_argmax
from batchgen.kernels.rmsnorm import add_rmsnorm, rmsnorm
from batchgen.kernels.rope_store_kv import rope_store_kv
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.kernels.skinny_gemm import normed_skinny_gemm, skinny_gemm


def test_no_pdl_off_the_gpu():
    assert pdl.pdl_launch_args(torch.device("cpu")) == {"PDL": False}


def _decode_chain(x, weights, cache, steps):
    """A decode layer's kernels, each reading what the one before wrote, `steps` times over: one that
    read before its wait would see the previous round's values."""
    hidden, residual = x, torch.zeros_like(x)
    k_cache, v_cache, cos_sin, req_to_token = cache
    for step in range(steps):
        qkv, residual = normed_skinny_gemm(hidden, residual, weights["norm"], 1e-6, weights["qkv"])
        q, k, v = qkv.view(1, -1, 64).split([4, 2, 2], dim=1)
        position = torch.full((1,), step, dtype=torch.int64, device=x.device)
        rope_store_kv(q, k, v, position, cos_sin, k_cache, v_cache, position)
        lens = position.to(torch.int32) + 1
        attn = decode_attention(q, k_cache, v_cache, req_to_token, torch.zeros(1, dtype=torch.int32, device=x.device),
                                lens, max_kv_len=req_to_token.shape[1], scale=0.125)  # several splits: the merge too
        hidden = skinny_gemm(attn.view(1, -1), weights["o"])
        normed, residual = add_rmsnorm(hidden, residual, weights["norm"], 1e-6)
        gate_up = skinny_gemm(normed, weights["gate_up"])
        hidden = skinny_gemm(silu_and_mul(gate_up), weights["down"]) + skinny_gemm(gate_up, weights["down"], silu_mul=True)
    logits = skinny_gemm(rmsnorm(hidden, weights["norm"], 1e-6), weights["head"], out_dtype=torch.float32)
    one = torch.ones(1, device=x.device)
    return hidden, gumbel_argmax(logits, one, one.long(), one.long())


@pytest.mark.gpu
def test_dependent_kernels_in_a_graph_match_eager_without_pdl(monkeypatch):
    """Every kernel that takes PDL, chained as in a decode step and replayed from a CUDA graph with
    PDL, gives bit for bit what the same kernels give run eagerly without it."""
    if not pdl.pdl_launch_args(torch.device("cuda")).get("PDL"):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hid, steps = 256, 24
    weights = {"norm": torch.rand(hid, device=dev, dtype=dt) + 0.5,
               "qkv": torch.randn(8 * 64, hid, device=dev, dtype=dt) / 16,
               "o": torch.randn(hid, 4 * 64, device=dev, dtype=dt) / 16,
               "gate_up": torch.randn(2 * 512, hid, device=dev, dtype=dt) / 16,
               "down": torch.randn(hid, 512, device=dev, dtype=dt) / 23,
               "head": torch.randn(1000, hid, device=dev, dtype=dt) / 16}

    slots = 1024
    angles = torch.arange(slots, device=dev)[:, None] * torch.rand(32, device=dev)[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    req_to_token = torch.arange(slots, device=dev, dtype=torch.int32)[None]

    def fresh_cache():
        k_cache = torch.zeros(slots, 2, 64, device=dev, dtype=dt)
        return k_cache, torch.zeros_like(k_cache), cos_sin, req_to_token

    x = torch.randn(1, hid, device=dev, dtype=dt)
    with monkeypatch.context() as m:
        m.setattr(pdl, "_supported", lambda index: False)
        assert pdl.pdl_launch_args(torch.device(dev)) == {"PDL": False}
        want_hidden, want_token = _decode_chain(x, weights, fresh_cache(), steps)
    cache = fresh_cache()
    _decode_chain(x, weights, cache, steps)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_hidden, got_token = _decode_chain(x, weights, cache, steps)
    for _ in range(3):
        for t in cache[:2]:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got_hidden, want_hidden)
        assert torch.equal(got_token, want_token)
