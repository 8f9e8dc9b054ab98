"""Values into and out of the KV pool's dtype.

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
    multiplies in fp16: fp8 widens to fp16 in one instruction (sm_89+), to bf16 only through fp32.
    A bf16 q is exact in fp16 from 6.1e-5 to 65504 (clamped there: fp16 has no room past it)."""
    if cache_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


def cast_for_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The torch form of to_cache_dtype."""
    if cache_dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_dtype)
