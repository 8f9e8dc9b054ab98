import pytest
import torch

from batchgen.kernels import device
from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.gumbel_argmax import gumbel_argmax
from batchgen.kernels.rmsnorm import add_rmsnorm, rmsnorm
from batchgen.kernels.rope_store_kv import rope_store_kv
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.kernels.skinny_gemm import normed_skinny_gemm, skinny_gemm
from batchgen.kernels.unified_attention import unified_attention


def test_no_pdl_off_the_gpu():
    assert device.pdl_launch_args(torch.device("cpu")) == {"PDL": False}


def test_use_pdl_false_turns_it_off_on_a_gpu_too():
    """EngineConfig.pdl = False (use_pdl(False)): no kernel asks for PDL, whatever the GPU."""
    try:
        device.use_pdl(False)
        assert device.pdl_launch_args(torch.device("cuda", 0)) == {"PDL": False}
    finally:
        device.use_pdl(True)


def test_build_model_passes_engine_config_pdl(tiny_model):
    """build_model(pdl=False) (the runner passes EngineConfig.pdl) turns PDL off for the model's kernels."""
    from batchgen.models.loader import build_model
    from batchgen.models.model_config import load_model_config

    model_dir = tiny_model("llama")
    try:
        build_model(load_model_config(model_dir), model_dir, torch.float32, torch.device("cpu"), 64, pdl=False)
        assert device.pdl_launch_args(torch.device("cuda", 0)) == {"PDL": False}
    finally:
        device.use_pdl(True)


def _decode_chain(x, weights, cache, fixed, steps):
    """A decode layer's kernels, `steps` times over, each launched right after the kernel whose output
    it reads (the small index tensors are slices of ones made before: a slice launches nothing), so a
    kernel that read before its wait would see the previous round's values. Odd steps take unified
    attention and the down projection with SiLU·mul inside; even steps decode attention (split and
    merge) and the SiLU-and-mul kernel."""
    k_cache, v_cache, cos_sin, req_to_token = cache
    positions, lens, q_start, seq_row, (temperature, seed, gen_step) = fixed
    hidden, residual = x, None
    for step in range(steps):
        qkv, residual = normed_skinny_gemm(hidden, residual, weights["norm"], 1e-6, weights["qkv"])
        q, k, v = qkv.view(1, -1, 64).split([4, 2, 2], dim=1)
        position, kv_len = positions[step : step + 1], lens[step : step + 1]
        rope_store_kv(q, k, v, position, cos_sin, k_cache, v_cache, position)
        if step % 2:
            attn = unified_attention(q, k_cache, v_cache, req_to_token, seq_row, q_start, kv_len, scale=0.125)
        else:  # several splits (the context bound is the table's width): the merge kernel runs too
            attn = decode_attention(q, k_cache, v_cache, req_to_token, seq_row, kv_len,
                                    max_kv_len=req_to_token.shape[1], scale=0.125)
        normed, residual = add_rmsnorm(skinny_gemm(attn.view(1, -1), weights["o"]), residual, weights["norm"], 1e-6)
        gate_up = skinny_gemm(normed, weights["gate_up"])
        if step % 2:
            hidden = skinny_gemm(gate_up, weights["down"], silu_mul=True)
        else:
            hidden = skinny_gemm(silu_and_mul(gate_up), weights["down"])
    logits = skinny_gemm(rmsnorm(hidden, weights["norm"], 1e-6), weights["head"], out_dtype=torch.float32)
    return hidden, residual, gumbel_argmax(logits, temperature, seed, gen_step)


@pytest.mark.gpu
def test_dependent_kernels_with_pdl_match_them_without():
    """Every kernel that takes PDL, chained as in a decode step, run eagerly with PDL and replayed
    from a CUDA graph with PDL, gives bit for bit what the same kernels give eagerly without it."""
    if not device.pdl_launch_args(torch.device("cuda")).get("PDL"):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hid, steps, slots = 256, 24, 1024
    weights = {"norm": torch.rand(hid, device=dev, dtype=dt) + 0.5,
               "qkv": torch.randn(8 * 64, hid, device=dev, dtype=dt) / 16,
               "o": torch.randn(hid, 4 * 64, device=dev, dtype=dt) / 16,
               "gate_up": torch.randn(2 * 512, hid, device=dev, dtype=dt) / 16,
               "down": torch.randn(hid, 512, device=dev, dtype=dt) / 23,
               "head": torch.randn(1000, hid, device=dev, dtype=dt) / 16}
    angles = torch.arange(slots, device=dev)[:, None] * torch.rand(32, device=dev)[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    req_to_token = torch.arange(slots, device=dev, dtype=torch.int32)[None]  # position p in slot p
    one = torch.ones(1, device=dev)
    fixed = (torch.arange(steps, device=dev), torch.arange(1, steps + 1, device=dev, dtype=torch.int32),
             torch.tensor([0, 1], device=dev, dtype=torch.int32), torch.zeros(1, device=dev, dtype=torch.int32),
             (one, one.long(), one.long()))
    x = torch.randn(1, hid, device=dev, dtype=dt)

    def fresh_cache():
        k_cache = torch.zeros(slots, 2, 64, device=dev, dtype=dt)
        return k_cache, torch.zeros_like(k_cache), cos_sin, req_to_token

    try:
        device.use_pdl(False)
        assert device.pdl_launch_args(torch.device(dev)) == {"PDL": False}
        want = _decode_chain(x, weights, fresh_cache(), fixed, steps)
    finally:
        device.use_pdl(True)
    eager = _decode_chain(x, weights, fresh_cache(), fixed, steps)  # with PDL (and compiles it)
    torch.cuda.synchronize()
    for got, expected in zip(eager, want):
        assert torch.equal(got, expected)
    cache = fresh_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _decode_chain(x, weights, cache, fixed, steps)
    for _ in range(3):
        for t in cache[:2]:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(replayed, want):
            assert torch.equal(got, expected)
