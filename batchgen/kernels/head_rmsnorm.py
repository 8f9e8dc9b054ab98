"""Qwen3's q/k norm: RMSNorm over each head of q and of k, in place in the qkv product's output, one launch.

    qkv [T, (Hq + 2 Hk) D]: Hq heads of q, then Hk heads of k, then Hk of v (left alone)
    x <- rmsnorm(x) * q_weight on q's heads, rmsnorm(x) * k_weight on k's   (rounded as kernels/rmsnorm.py)

In place, q and k stay strided views of qkv, as in models without the norm: no copy of q or k into
contiguous rows, and one launch for both. Each head is normalised on its own, whatever the batch holds.
"""
import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.rmsnorm import rmsnorm_ref

ELEMENTS_PER_PROGRAM = 2048  # a program's [heads, BLOCK_D] tile


@triton.jit(do_not_specialize=["eps"])
def _head_rmsnorm_kernel(
    qkv_ptr,  # [T, >= (Hq + Hk) D], normalised in place
    row_stride,  # elements between two tokens of qkv
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    num_q_heads,  # Hq
    num_heads,  # Hq + Hk
    eps,
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # next power of 2 >= D
    BLOCK_HEADS: tl.constexpr,  # heads a program
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)  # the product wrote qkv
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    mask = (heads < num_heads)[:, None] & dim_ok[None, :]
    ptrs = qkv_ptr + token * row_stride + heads[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)  # [BLOCK_HEADS]
    q_weight = tl.load(q_weight_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    k_weight = tl.load(k_weight_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    weight = tl.where((heads < num_q_heads)[:, None], q_weight[None, :], k_weight[None, :])
    # (the normalised head rounded to x's dtype first, as the reference; the 16-bit product is exact in fp32)
    y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * weight
    tl.store(ptrs, y.to(x.dtype), mask=mask)


def head_rmsnorm_triton(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, eps: float) -> None:
    """The module's formula on qkv [T, (Hq + 2 Hk) D] in place, in one launch."""
    num_tokens = qkv.shape[0]
    head_dim = q_weight.shape[0]
    num_heads = num_q_heads + num_kv_heads
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_heads = min(triton.next_power_of_2(num_heads), max(1, ELEMENTS_PER_PROGRAM // block_d))
    _head_rmsnorm_kernel[(num_tokens, triton.cdiv(num_heads, block_heads))](
        qkv, qkv.stride(0), q_weight, k_weight, num_q_heads, num_heads, eps,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_HEADS=block_heads,
        num_warps=4 if block_heads * block_d >= 1024 else 1, **pdl_launch_args(qkv.device),
    )


def head_rmsnorm_ref(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float) -> None:
    """The formula with kernels/rmsnorm.py's reference on each head, written back into qkv."""
    head_dim = q_weight.shape[0]
    q_size, k_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].unflatten(1, (num_q_heads, head_dim))
    k = qkv[:, q_size:q_size + k_size].unflatten(1, (num_kv_heads, head_dim))
    q.copy_(rmsnorm_ref(q, q_weight, eps))
    k.copy_(rmsnorm_ref(k, k_weight, eps))


def head_rmsnorm_(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> None:
    """qkv [T, (Hq + 2 Hk) D] with contiguous rows; q_weight, k_weight [D] contiguous, in qkv's dtype (the
    result is written where the input was)."""
    head_dim = q_weight.shape[0]
    assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (num_q_heads + num_kv_heads) * head_dim
    assert q_weight.dtype == k_weight.dtype == qkv.dtype and k_weight.shape == (head_dim,)
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    if qkv.is_cuda:
        head_rmsnorm_triton(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, eps)
    else:
        head_rmsnorm_ref(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, eps)
