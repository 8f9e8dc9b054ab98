"""The engine's CPU rotation (rope_store_kv's CPU path) against the reference; the model's cos/sin table."""
import pytest
import torch

from batchgen.kernels.rope_store_kv import apply_rotary_cpu, apply_rotary_ref
from batchgen.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cos_sin_cache(max_pos, head_dim, device):
    """The model's [P, D] table (theta 10000, no scaling)."""
    return RotaryEmbedding(head_dim, max_pos, 10000.0, {}).cos_sin_cache.to(device)


def _fused_views(qkv, q_heads, kv_heads, head_dim):
    """q [T, Hq, D] and k [T, Hk, D] as the model makes them: strided views into one qkv output."""
    q = qkv[:, : q_heads * head_dim].view(len(qkv), q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(len(qkv), kv_heads, head_dim)
    return q, k


def _assert_rotates_like_ref(rotate, assert_close, qkv, q, k, positions, cache):
    """rotate(q, k, positions, cache), in place, gives the reference's q and k and leaves the rest
    of qkv (v) untouched."""
    v_start = q[0].numel() + k[0].numel()
    ref_q, ref_k = q.clone(), k.clone()
    apply_rotary_ref(ref_q, ref_k, positions, cache)
    v_before = qkv[:, v_start:].clone()
    rotate(q, k, positions, cache)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(qkv[:, v_start:], v_before)


@pytest.mark.interpreter_bf16
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 1, 1, 8), (7, 4, 2, 20), (13, 9, 3, 64)])
@pytest.mark.parametrize("fused", [True, False])
def test_rotary_cpu_path(assert_close, dtype, tokens, q_heads, kv_heads, head_dim, fused):
    """The engine's CPU path against the reference, on CPU whatever the machine: on the views of a
    fused qkv output (q and k rotated as one) and on separate tensors (Qwen3 after its q/k norms)."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    if fused:
        q, k = _fused_views(qkv, q_heads, kv_heads, head_dim)
    else:
        q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    _assert_rotates_like_ref(apply_rotary_cpu, assert_close, qkv, q, k, positions, _cos_sin_cache(300, head_dim, "cpu"))
