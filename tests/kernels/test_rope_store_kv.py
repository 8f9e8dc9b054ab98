import pytest
import torch

from batchgen.kernels.rope_store_kv import rope_store_kv, rope_store_kv_ref, rope_store_kv_triton
from tests.kernels.test_rotary import _cos_sin_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, q heads, kv heads, head_dim, slots): one token, primes, head_dim/2 not a power of 2 (20,
# 80), Hq == Hk; llama-3.2-1b, llama-3.1-8b and Qwen2.5-0.5b-like shapes on the GPU.
SHAPES = [(1, 1, 1, 8, 3), (7, 4, 2, 20, 50), (13, 6, 3, 64, 13), (5, 3, 3, 16, 9)] + [
    pytest.param(*s, marks=pytest.mark.gpu)
    for s in [(257, 32, 8, 64, 4096), (8191, 32, 8, 128, 10007), (5, 14, 2, 80, 77), (31, 14, 2, 64, 31)]
]


def _inputs(tokens, q_heads, kv_heads, head_dim, num_slots, dtype, device, seed=0, fused=True):
    """q, k, v as strided views into one qkv output (fused) or separate tensors (Qwen3 after its
    q/k norms), caches with random contents, int32 positions and slots."""
    gen = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
        q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    else:
        q, k, v = (torch.randn(tokens, h * head_dim, generator=gen).to(device, dtype)
                   for h in (q_heads, kv_heads, kv_heads))
    q, k, v = (x.view(tokens, h, head_dim) for x, h in zip((q, k, v), (q_heads, kv_heads, kv_heads)))
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=gen).int().to(device)
    out_slots = torch.randperm(num_slots, generator=gen)[:tokens].int().to(device)
    return q, k, v, positions, _cos_sin_cache(5000, head_dim, device), k_cache, v_cache, out_slots


def _clone(args):
    return [a.clone() for a in args]


def _assert_same_outcome(assert_close, actual, expected, out_slots):
    """q and the caches as the expected run left them: v and untouched slots exactly."""
    q, _, _, _, _, k_cache, v_cache, _ = actual
    ref_q, _, _, _, _, ref_k_cache, ref_v_cache, _ = expected
    assert_close(q, ref_q)
    assert torch.equal(v_cache, ref_v_cache)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    untouched[out_slots.long()] = False
    assert torch.equal(k_cache[untouched], ref_k_cache[untouched])
    assert_close(k_cache, ref_k_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,num_slots", SHAPES)
@pytest.mark.parametrize("fused", [True, False])
def test_rope_store_kv(device, assert_close, dtype, tokens, q_heads, kv_heads, head_dim, num_slots, fused):
    args = _inputs(tokens, q_heads, kv_heads, head_dim, num_slots, dtype, device, fused=fused)
    expected = _clone(args)
    rope_store_kv_ref(*expected)
    k_before = args[1].clone()
    rope_store_kv_triton(*args)
    _assert_same_outcome(assert_close, args, expected, args[7])
    assert torch.equal(args[1], k_before)  # k is only read


@pytest.mark.interpreter_bf16
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [True, False])
def test_rope_store_kv_cpu_path(assert_close, dtype, fused):
    """The public function on CPU tensors (the engine's CPU path) against the reference."""
    args = _inputs(13, 9, 3, 64, 20, dtype, "cpu", seed=2, fused=fused)
    expected = _clone(args)
    rope_store_kv_ref(*expected)
    rope_store_kv(*args)
    _assert_same_outcome(assert_close, args, expected, args[7])


def test_rope_store_kv_no_tokens(device):
    args = _inputs(0, 4, 2, 16, 5, torch.float32, device)
    caches = _clone(args[5:7])
    rope_store_kv_triton(*args)
    assert torch.equal(args[5], caches[0]) and torch.equal(args[6], caches[1])
