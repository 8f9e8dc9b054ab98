import pytest
import torch

from batchgen.kernels.store_kv import store_kv_triton, store_kv_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, kv heads, head_dim, slots)
SHAPES = [(1, 1, 8, 4), (7, 3, 20, 50), (13, 2, 64, 13)] + [
    pytest.param(*s, marks=pytest.mark.gpu) for s in [(257, 8, 64, 4096), (4099, 8, 128, 10007)]
]


def _fused_kv(tokens, q_heads, kv_heads, head_dim, dtype, device):
    """k and v as views into a fused [T, (Hq + 2 Hk) * D] qkv output, as the model hands them over."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return k, v


@pytest.mark.interpreter_bf16
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,kv_heads,head_dim,num_slots", SHAPES)
def test_store_kv(device, dtype, tokens, kv_heads, head_dim, num_slots):
    torch.manual_seed(0)
    k, v = _fused_kv(tokens, 2 * kv_heads, kv_heads, head_dim, dtype, device)
    assert tokens == 1 or k.stride(0) != kv_heads * head_dim
    k_cache = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    out_slots = torch.randperm(num_slots, device=device)[:tokens]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, ref_k, ref_v, out_slots)
    store_kv_triton(k, v, k_cache, v_cache, out_slots.to(torch.int32))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.gpu
def test_store_kv_casts_to_cache_dtype(device):
    torch.manual_seed(1)
    k, v = _fused_kv(33, 4, 2, 64, torch.float32, device)
    k_cache = torch.zeros(40, 2, 64, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    out_slots = torch.randperm(40, device=device)[:33]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, ref_k, ref_v, out_slots)
    store_kv_triton(k, v, k_cache, v_cache, out_slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
