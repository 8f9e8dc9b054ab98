"""RMSNorm, alone and fused with the residual add.

    y = x / sqrt(mean(x^2) + eps) * weight          (statistics in fp32, as HF Llama computes them)
    add_rmsnorm: r' = x + r (in x's dtype);  y = rmsnorm(r')
    add_rmsnorm_parts: x = sum_s parts[s] (fp32, in split order, rounded to r's dtype), then add_rmsnorm
    (the fp32 parts of a split-K product: kernels/tile_gemm.py)

The normalised row is rounded to x's dtype before the weight multiplies it (HF Llama does the same),
so y has the dtype of (weight * x).
"""
import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.e4m3 import FP8, FP8_MAX, MIN_AMAX, quantize_ref


@triton.jit
def add_residual(x, r):
    """x + r as torch adds a product's output to the residual: x rounded to r's dtype (x may be an fp32
    sum: split-K parts, the one-row MLP's), the sum in fp32, rounded once to r's dtype."""
    return (x.to(r.dtype).to(tl.float32) + r.to(tl.float32)).to(r.dtype)


@triton.jit(do_not_specialize=["eps"])
def _rmsnorm_kernel(
    x_ptr,  # [T, H] input
    x_stride_t,  # elements between two rows of x
    part_stride,  # elements between two parts of x (NUM_PARTS > 0)
    residual_ptr,  # [T, H] residual (read only when HAS_RESIDUAL)
    residual_stride_t,  # elements between two rows of residual
    weight_ptr,  # [H] contiguous
    out_ptr,  # [T, H] normalised output
    out_stride_t,  # elements between two rows of out
    new_residual_ptr,  # [T, H] x + residual, written only when HAS_RESIDUAL
    new_residual_stride_t,  # elements between two rows of new_residual
    scale_ptr,  # [T, 1] fp32: each row's e4m3 scale (FP8_OUT)
    hidden,  # H
    eps,  # float
    HAS_RESIDUAL: tl.constexpr,
    NUM_PARTS: tl.constexpr,  # > 0: x is [NUM_PARTS, T, H] fp32 parts to sum (with a residual)
    BLOCK_H: tl.constexpr,  # next power of 2 >= H: one program holds a whole row
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
    FP8_OUT: tl.constexpr = False,  # out is e4m3: y (rounded to 16 bits) / its row's scale
    FP8_MAX: tl.constexpr = 448.0,
    MIN_AMAX: tl.constexpr = 1e-12,
):
    wait_for_prior_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride_t + cols, mask=mask, other=0.0)
    if NUM_PARTS > 0:
        for s in tl.static_range(1, NUM_PARTS):
            x += tl.load(x_ptr + s * part_stride + row * x_stride_t + cols, mask=mask, other=0.0)
        x = x.to(residual_ptr.dtype.element_ty)  # as the product rounds its output
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride_t + cols, mask=mask, other=0.0)
        x = add_residual(x, r)
        tl.store(new_residual_ptr + row * new_residual_stride_t + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # Round the normalised row to x's dtype as the reference does; the product of two 16-bit
    # floats is exact in fp32, so one more rounding gives the 16-bit product.
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    if FP8_OUT:  # (the 16-bit y that quantize would read; masked columns are 0)
        y = y.to(weight_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        y = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(out_ptr + row * out_stride_t + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, parts=None, fp8_out=False):
    """parts: [S, T, H] fp32 whose sum is x (then x is parts[0] and residual is required). fp8_out: out is
    e4m3 and a third tensor, the rows' scales [T, 1] fp32, comes back."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, H] with contiguous rows"
    assert weight.is_contiguous() and weight.shape == (x.shape[1],)
    num_tokens, hidden = x.shape
    x_dtype = x.dtype if parts is None else residual.dtype
    out_dtype = torch.promote_types(x_dtype, weight.dtype)
    assert not fp8_out or out_dtype == weight.dtype, "fp8_out rounds y to the weight's dtype"
    out = torch.empty(x.shape, dtype=FP8 if fp8_out else out_dtype, device=x.device)
    scales = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device) if fp8_out else out
    if residual is None:
        residual = new_residual = x  # placeholders, never touched
    else:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x_dtype
        new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return (out, scales, new_residual) if fp8_out else (out, new_residual)
    block_h = triton.next_power_of_2(hidden)
    # a row's elements 16 a thread, or 4 where they are sums of fp32 parts (16 warps for H = 2,048: the
    # parts' loads need the threads; a plain row gains nothing from more warps)
    num_warps = min(max(block_h // (512 if parts is None else 128), 1), 16)
    _rmsnorm_kernel[(num_tokens,)](
        x, x.stride(0), 0 if parts is None else parts.stride(0),
        residual, residual.stride(0),
        weight,
        out, out.stride(0),
        new_residual, new_residual.stride(0),
        scales,
        hidden, eps,
        HAS_RESIDUAL=residual is not x,
        NUM_PARTS=0 if parts is None else parts.shape[0],
        BLOCK_H=block_h,
        FP8_OUT=fp8_out,
        FP8_MAX=FP8_MAX,
        MIN_AMAX=MIN_AMAX,
        num_warps=num_warps,
        **pdl_launch_args(x.device),
    )
    return (out, scales, new_residual) if fp8_out else (out, new_residual)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def add_rmsnorm_parts_triton(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    assert parts.dim() == 3 and parts.dtype == torch.float32 and parts.shape[1:] == residual.shape
    return _launch(parts[0], residual, weight, eps, parts=parts)


def add_rmsnorm_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    parts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert parts is None or (parts.dim() == 3 and parts.dtype == torch.float32 and parts.shape[1:] == residual.shape)
    return _launch(x, residual, weight, eps, parts=parts, fp8_out=True)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def add_rmsnorm_parts_ref(
    parts: torch.Tensor | list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rmsnorm of the parts' fp32 sum in their order (as the kernels sum them), rounded once to the
    residual's dtype: split-K parts here, ranks' partial sums in kernels/all_reduce_rmsnorm.py."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return add_rmsnorm_ref(total.to(residual.dtype), residual, weight, eps)


def add_rmsnorm_fp8_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    parts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, x + residual): add_rmsnorm's y rounded by e4m3.quantize_ref, one scale a row (without a
    residual: rmsnorm's y, and x itself). parts: their sum is x (x is parts[0]), as add_rmsnorm_parts_ref
    takes them."""
    if parts is not None:
        y, new_residual = add_rmsnorm_parts_ref(parts, residual, weight, eps)
    elif residual is None:
        y, new_residual = rmsnorm_ref(x, weight, eps), x
    else:
        y, new_residual = add_rmsnorm_ref(x, residual, weight, eps)
    q, s = quantize_ref(y)
    return q, s, new_residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> [T, H]."""
    if x.is_cuda:
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rmsnorm(x + residual), x + residual)."""
    if x.is_cuda:
        return add_rmsnorm_triton(x, residual, weight, eps)
    return add_rmsnorm_ref(x, residual, weight, eps)


def add_rmsnorm_parts(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [S, T, H] fp32, residual [T, H] -> add_rmsnorm(sum of the parts, residual)."""
    if parts.is_cuda:
        return add_rmsnorm_parts_triton(parts, residual, weight, eps)
    return add_rmsnorm_parts_ref(parts, residual, weight, eps)


def add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    parts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (or residual None) -> (e4m3 q [T, H], fp32 scales [T, 1], x + residual): the
    normalised row as an FP8 product with per-token activations takes it. parts [S, T, H] fp32 (then x is
    parts[0] and residual required): x is their sum, as for add_rmsnorm_parts."""
    if x.is_cuda:
        return add_rmsnorm_fp8_triton(x, residual, weight, eps, parts)
    return add_rmsnorm_fp8_ref(x, residual, weight, eps, parts)
