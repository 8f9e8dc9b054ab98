"""Rotary position embedding (NeoX / HF "rotate_half" layout), applied in place to q and k.

For a head vector x = [x1, x2] (two halves of head_dim/2) at position p:
    x' = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin],   cos, sin = cos_sin_cache[p] (fp32)
Rope scaling (llama3, linear) is folded into the cache when it is built (layers/rotary.py).
"""
import torch
import triton
import triton.language as tl


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
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_kernel(
    q_ptr,  # [T, Hq, D], rotated in place
    q_stride_t,  # elements between two tokens of q (Hq * D, or more for a slice of a fused qkv)
    q_stride_h,  # elements between two heads of q
    k_ptr,  # [T, Hk, D], rotated in place
    k_stride_t,  # elements between two tokens of k
    k_stride_h,  # elements between two heads of k
    positions_ptr,  # [T] int32/int64 position of each token
    cos_sin_ptr,  # [P, D] fp32: cos in columns [0, D/2), sin in [D/2, D)
    cos_sin_stride_p,  # elements between two positions of the cache
    num_q_heads,
    num_kv_heads,
    half_dim,  # D / 2
    BLOCK_HQ: tl.constexpr,  # next power of 2 >= Hq
    BLOCK_HK: tl.constexpr,  # next power of 2 >= Hk
    BLOCK_HALF: tl.constexpr,  # next power of 2 >= D / 2
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cs_ptr = cos_sin_ptr + pos * cos_sin_stride_p + cols
    cos = tl.load(cs_ptr, mask=cols < half_dim, other=0.0)
    sin = tl.load(cs_ptr + half_dim, mask=cols < half_dim, other=0.0)
    _rotate_heads(q_ptr + token * q_stride_t, q_stride_h, num_q_heads, half_dim, cos, sin,
                  BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_stride_t, k_stride_h, num_kv_heads, half_dim, cos, sin,
                  BLOCK_HK, BLOCK_HALF)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and positions.shape == (num_tokens,)
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head_dim axis of q and k must be contiguous"
    assert head_dim % 2 == 0 and cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32
    if num_tokens == 0:
        return
    block_half = triton.next_power_of_2(head_dim // 2)
    block_hq = triton.next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        positions,
        cos_sin_cache, cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, head_dim // 2,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half <= 2048 else 8,
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


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (modified in place); positions: [T]; cos_sin_cache: [P, D] fp32
    holding cos in its first D/2 columns and sin in the last D/2."""
    if q.is_cuda:
        apply_rotary_triton(q, k, positions, cos_sin_cache)
    else:
        apply_rotary_cpu(q, k, positions, cos_sin_cache)
