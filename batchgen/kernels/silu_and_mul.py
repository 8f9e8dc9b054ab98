"""SiLU-and-mul on the fused gate/up projection:  y = silu(x[:, :I]) * x[:, I:].

    silu(g) = g * sigmoid(g) = g / (1 + exp(-g))
The Triton kernel computes y in fp32 and rounds once; the reference rounds silu(g) to x's dtype
before the product, so the two differ by about one rounding of x's dtype.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]: gate in columns [0, I), up in [I, 2I)
    x_stride_t,  # elements between two rows of x
    out_ptr,  # [T, I]
    out_stride_t,  # elements between two rows of out
    inter,  # I
    BLOCK: tl.constexpr,  # columns per program
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride_t + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride_t + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, x.stride(0),
        out, out.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
        **pdl_launch_args(x.device),
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] -> [T, I]."""
    if x.is_cuda:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
