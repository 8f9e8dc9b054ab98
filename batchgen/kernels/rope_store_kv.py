"""Rotary position embedding and the KV store in one pass: q is rotated in place, k is rotated on
its way into the cache, v is copied:
    q[t]                  = rope(q[t], positions[t])
    k_cache[out_slots[t]] = rope(k[t], positions[t])
    v_cache[out_slots[t]] = v[t]
    rope([x1, x2], p)     = [x1 cos - x2 sin, x2 cos + x1 sin],   cos, sin = cos_sin_cache[p]
(NeoX / HF "rotate_half" halves; cos_sin_cache [P, D] = [cos | sin] fp32, rope scaling folded in by
layers/rotary.py; fp32 math rounded to the input dtype, then cast to the pool's dtype as
kernels/kv_dtype.py does). k itself is only read on the GPU (afterwards its contents are unspecified:
the CPU path, which rotates, then stores, leaves it rotated).
"""
import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.kv_dtype import cast_for_cache, to_cache_dtype


@triton.jit
def _rotate_heads(
    x_ptr,  # first element of this token's row of q or k
    head_stride,  # elements between two heads of a token
    num_heads,
    half_dim,  # head_dim / 2
    cos,  # [1, BLOCK_HALF] fp32
    sin,  # [1, BLOCK_HALF] fp32
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half_dim)
    ptr1 = x_ptr + heads * head_stride + cols  # [BLOCK_HEADS, BLOCK_HALF], first halves
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half_dim, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptr1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(ptr1 + half_dim, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


# index arrays not specialized on alignment (kernels/__init__.py)
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "out_slots_ptr"])
def _rope_store_kv_kernel(
    q_ptr,  # [T, Hq, D], rotated in place (may be a slice of the fused qkv output)
    q_stride_t,  # elements between two tokens of q
    q_stride_h,  # elements between two heads of q
    k_ptr,  # [T, Hk, D] new keys, read only
    k_stride_t,  # elements between two tokens of k
    k_stride_h,  # elements between two heads of k
    v_ptr,  # [T, Hk, D] new values, read only
    v_stride_t,  # elements between two tokens of v
    v_stride_h,  # elements between two heads of v
    k_cache_ptr,  # [num_slots, Hk, D]
    v_cache_ptr,  # [num_slots, Hk, D]
    cache_stride_s,  # elements between two slots of either cache
    cache_stride_h,  # elements between two heads of either cache
    positions_ptr,  # [T] int32/int64 position of each token
    out_slots_ptr,  # [T] int32/int64 slot of each token
    cos_sin_ptr,  # [P, D] fp32: cos in columns [0, D/2), sin in [D/2, D)
    cos_sin_stride_p,  # elements between two positions of the cache
    num_q_heads,
    num_kv_heads,
    half_dim,  # D / 2
    BLOCK_HQ: tl.constexpr,  # next power of 2 >= Hq
    BLOCK_HK: tl.constexpr,  # next power of 2 >= Hk
    BLOCK_HALF: tl.constexpr,  # next power of 2 >= D / 2
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(out_slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cs_ptr = cos_sin_ptr + pos * cos_sin_stride_p + cols
    cos = tl.load(cs_ptr, mask=cols < half_dim, other=0.0)  # [1, BLOCK_HALF]
    sin = tl.load(cs_ptr + half_dim, mask=cols < half_dim, other=0.0)
    _rotate_heads(q_ptr + token * q_stride_t, q_stride_h, num_q_heads, half_dim, cos, sin, BLOCK_HQ, BLOCK_HALF)

    heads = tl.arange(0, BLOCK_HK)[:, None]
    mask = (heads < num_kv_heads) & (cols < half_dim)  # [BLOCK_HK, BLOCK_HALF], one half of each head
    k1_ptr = k_ptr + token * k_stride_t + heads * k_stride_h + cols
    v1_ptr = v_ptr + token * v_stride_t + heads * v_stride_h + cols
    cache_offs = slot * cache_stride_s + heads * cache_stride_h + cols
    cache_ty = k_cache_ptr.dtype.element_ty
    k1 = tl.load(k1_ptr, mask=mask, other=0.0)
    k2 = tl.load(k1_ptr + half_dim, mask=mask, other=0.0)
    v1 = tl.load(v1_ptr, mask=mask)
    v2 = tl.load(v1_ptr + half_dim, mask=mask)
    k1f = k1.to(tl.float32)
    k2f = k2.to(tl.float32)
    # rounded to k's dtype first, as apply_rotary_ref's output is
    tl.store(k_cache_ptr + cache_offs, to_cache_dtype((k1f * cos - k2f * sin).to(k1.dtype), cache_ty), mask=mask)
    tl.store(k_cache_ptr + cache_offs + half_dim, to_cache_dtype((k2f * cos + k1f * sin).to(k1.dtype), cache_ty),
             mask=mask)
    tl.store(v_cache_ptr + cache_offs, to_cache_dtype(v1, cache_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs + half_dim, to_cache_dtype(v2, cache_ty), mask=mask)


def rope_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert positions.shape == out_slots.shape == (num_tokens,)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "the head_dim axis must be contiguous"
    assert head_dim % 2 == 0 and cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and k_cache.stride(2) == 1
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert v_cache.dtype == k_cache.dtype
    if num_tokens == 0:
        return
    block_half = triton.next_power_of_2(head_dim // 2)
    block_hq = triton.next_power_of_2(num_q_heads)
    _rope_store_kv_kernel[(num_tokens,)](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        positions, out_slots,
        cos_sin_cache, cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, head_dim // 2,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half <= 2048 else 8,
        **pdl_launch_args(q.device),
    )


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))



def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    """k_cache[out_slots] = k, v_cache[out_slots] = v, in the pool's dtype."""
    k_cache[out_slots] = cast_for_cache(k, k_cache.dtype)
    v_cache[out_slots] = cast_for_cache(v, v_cache.dtype)


def apply_rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """The CPU path, in fewer (and larger) ops than the reference: with x = [x1, x2] per head,
    x' = x * [cos, cos] + [x2, x1] * [-sin, sin]; and when k's heads follow q's in the same rows (the
    views of one fused qkv output), q and k are rotated as one tensor."""
    num_tokens, num_q_heads, head_dim = q.shape
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)  # [T, D/2] fp32 each
    cos = cos[:, None, None, :]  # against x viewed as [T, H, 2, D/2]
    signed_sin = torch.stack((-sin, sin), dim=1)[:, None]  # [T, 1, 2, D/2]
    follows = k.stride() == q.stride() and k.data_ptr() == q.data_ptr() + num_q_heads * head_dim * q.element_size()
    if follows and q.stride(2) == 1 and q.stride(1) == head_dim:
        parts = [q.as_strided((num_tokens, num_q_heads + k.shape[1], head_dim), q.stride())]
    else:
        parts = [q, k]
    for x in parts:
        xf = x.float().view(num_tokens, -1, 2, head_dim // 2)
        x.copy_(torch.addcmul(xf * cos, xf.flip(2), signed_sin).view(x.shape))



def rope_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    """The rotation, then the store."""
    apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, out_slots)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    """q: [T, Hq, D] (rotated in place); k, v: [T, Hk, D]; positions, out_slots: [T] int;
    cos_sin_cache: [P, D] fp32 = [cos | sin]; k_cache, v_cache: [num_slots, Hk, D] (written at
    out_slots)."""
    if q.is_cuda:
        rope_store_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_slots)
    else:
        apply_rotary_cpu(q, k, positions, cos_sin_cache)
        store_kv_ref(k, v, k_cache, v_cache, out_slots)
