"""Store the K/V of the step's new tokens into their slots of the token pool:
    k_cache[out_slots[t]] = k[t],  v_cache[out_slots[t]] = v[t]

The pool may hold fp8 (e4m3, `--kv-cache-dtype fp8`) while the model computes in 16 bits: values
are clamped to fp8's finite range (+-448: float8_e4m3fn has no infinity, and a value past it would
become NaN) and rounded to nearest, with no scale, as vLLM does without calibrated scales. Readers
widen K/V to the dtype their products run in (query_for_kv_dot).
"""
import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


@triton.jit
def to_cache_dtype(x, cache_ty: tl.constexpr):
    """x rounded to the pool's dtype; saturating for fp8."""
    if cache_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(cache_ty)


@triton.jit
def query_for_kv_dot(q, cache_ty: tl.constexpr):
    """q in the dtype its products with the pool's K/V run in. An fp8 pool under a 16-bit model
    multiplies in fp16: fp8 widens to fp16 in one instruction (sm_89+) but to bf16 only through
    fp32, which made fp8 decode attention slower than bf16 (H200, benchmarks/KERNELS.md). A bf16 q
    is exact in fp16 from 6.1e-5 to 65504 (clamped there: fp16 has no room past it)."""
    if cache_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


def cast_for_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The torch form of to_cache_dtype."""
    if cache_dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_dtype)


# index arrays not specialized on alignment (kernels/__init__.py)
@triton.jit(do_not_specialize_on_alignment=["out_slots_ptr"])
def _store_kv_kernel(
    k_ptr,  # [T, Hk, D] new keys (may be a slice of the fused qkv output)
    k_stride_t,  # elements between two tokens of k
    k_stride_h,  # elements between two heads of k
    v_ptr,  # [T, Hk, D] new values
    v_stride_t,  # elements between two tokens of v
    v_stride_h,  # elements between two heads of v
    k_cache_ptr,  # [num_slots, Hk, D]
    v_cache_ptr,  # [num_slots, Hk, D]
    cache_stride_s,  # elements between two slots of either cache
    cache_stride_h,  # elements between two heads of either cache
    out_slots_ptr,  # [T] slot of each new token
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,  # next power of 2 >= Hk
    BLOCK_D: tl.constexpr,  # next power of 2 >= D
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_slots_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (cols < head_dim)
    cache_offs = slot * cache_stride_s + heads * cache_stride_h + cols
    k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + cols, mask=mask)
    tl.store(k_cache_ptr + cache_offs, to_cache_dtype(k, k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + cols, mask=mask)
    tl.store(v_cache_ptr + cache_offs, to_cache_dtype(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and out_slots.shape == (num_tokens,)
    assert k.stride(2) == 1 and v.stride(2) == 1, "the head_dim axis of k and v must be contiguous"
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and k_cache.stride(2) == 1
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        out_slots,
        num_kv_heads, head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    k_cache[out_slots] = cast_for_cache(k, k_cache.dtype)
    v_cache[out_slots] = cast_for_cache(v, v_cache.dtype)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [num_slots, Hk, D]; out_slots: [T] int."""
    if k.is_cuda:
        store_kv_triton(k, v, k_cache, v_cache, out_slots)
    else:
        store_kv_ref(k, v, k_cache, v_cache, out_slots)
