"""A token's MoE output on a rank that holds some of the experts (expert parallelism: layers/moe.py):
the sum of its pairs routed to this rank's experts, zero where none is.

    out[t] = sum_j [first <= topk_ids[t, j] < first + E] * y[t * k + j]      (fp32 sums, rounded once)

y's rows of other ranks' pairs were never written (kernels/moe_align.py gives them no slot), so they are
masked, never multiplied by zero (unwritten memory can hold NaN). One program a token and column block;
the masked rows are not read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.moe_align import local_expert_ids

BLOCK_H = 512  # columns a program sums


@triton.jit(do_not_specialize=["first_expert"])
def _sum_kept_pairs_kernel(
    y_ptr,  # [T*k, H], rows y_stride apart
    y_stride,
    ids_ptr,  # [T*k] int32: each pair's expert (the model's numbering)
    out_ptr,  # [T, H] out, rows out_stride apart
    out_stride,
    hidden,
    first_expert,  # this rank's experts: first_expert .. first_expert + num_experts - 1
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    wait_for_prior_kernels(PDL)  # the down product wrote y
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair) - first_expert + tl.zeros([BLOCK_H], dtype=tl.int32)  # (as a row)
        kept = (expert >= 0) & (expert < num_experts)
        acc += tl.load(y_ptr + pair * y_stride + cols, mask=col_ok & kept, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def sum_kept_pairs(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_experts: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*k, H], topk_ids [T, k] -> [T, H] in y's dtype (into out where given): the module's formula."""
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    assert y.shape[0] == num_tokens * top_k and y.stride(1) == 1
    out = torch.empty((num_tokens, hidden), dtype=y.dtype, device=y.device) if out is None else out
    assert out.shape == (num_tokens, hidden) and out.stride(1) == 1
    if num_tokens == 0:
        return out
    ids = topk_ids.reshape(-1).to(torch.int32)
    _sum_kept_pairs_kernel[(num_tokens, triton.cdiv(hidden, BLOCK_H))](
        y, y.stride(0), ids, out, out.stride(0), hidden, first_expert, num_experts,
        TOP_K=top_k, BLOCK_H=BLOCK_H, num_warps=4, **pdl_launch_args(y.device),
    )
    return out


def sum_kept_pairs_reference(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int,
                             num_experts: int) -> torch.Tensor:
    """The formula in torch: other ranks' rows replaced by zeros (whatever they hold), summed in fp32."""
    num_tokens, top_k = topk_ids.shape
    kept = (local_expert_ids(topk_ids, first_expert, num_experts) < num_experts).view(num_tokens, top_k, 1)
    rows = y.view(num_tokens, top_k, -1).float()
    return torch.where(kept, rows, torch.zeros((), device=y.device)).sum(dim=1).to(y.dtype)
