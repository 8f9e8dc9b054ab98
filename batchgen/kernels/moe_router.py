"""A MoE router's choice: each token's k most probable experts and their weights.

    probs[t] = softmax(logits[t]) in fp32
    ids[t]   = the k experts of largest probs[t], largest first
    w[t, j]  = probs[t, ids[t, j]], divided by their sum over the k where renormalized (Mixtral,
               Qwen3-MoE's norm_topk_prob)

On a GPU one Triton launch (`_router_kernel`: a program's rows in registers, the softmax, then k rounds of
argmax-and-mask) where torch's softmax, top-k and division take several kernels, on every tensor-parallel
rank (the router is replicated); on CPU those torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels

ELEMENTS_PER_PROGRAM = 2048  # [BLOCK_T, BLOCK_E] fp32 probabilities a program holds


@triton.jit
def _router_kernel(
    logits_ptr, logits_stride,  # [T, E] (any float dtype), rows logits_stride apart
    weights_ptr, ids_ptr,  # [T, TOP_K] fp32 / int32, contiguous
    num_tokens, num_experts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)  # the router's product wrote the logits
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    picks = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (experts[None, :] < num_experts)
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * logits_stride + experts[None, :], mask=mask,
                     other=-float("inf")).to(tl.float32)
    logits = tl.where(row_ok[:, None], logits, 0.0)  # (rows past T: finite, never stored)
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    # What the picks rank: the probabilities, NaN above them all (as torch's sort ranks it), the padding
    # columns below: every id names an expert whatever the logits (a NaN row of a graph's padding included)
    key = tl.where(probs == probs, probs, 2.0)
    key = tl.where(experts[None, :] < num_experts, key, -2.0)
    weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        # the first expert holding it (torch.topk's order among equal values is not promised either)
        pick = tl.min(tl.where(key == best[:, None], experts[None, :], BLOCK_E), axis=1)
        weight = tl.where(best > 1.5, float("nan"), best)
        weights = tl.where(picks[None, :] == j, weight[:, None], weights)
        ids = tl.where(picks[None, :] == j, pick[:, None], ids)
        key = tl.where(experts[None, :] == pick[:, None], -3.0, key)  # (below every other column)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # (picks past TOP_K hold 0)
    out = rows[:, None] * TOP_K + picks[None, :]
    out_mask = row_ok[:, None] & (picks[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


def select_experts_triton(router_logits: torch.Tensor, top_k: int,
                          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in one launch (the module's docstring)."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1 and 1 <= top_k <= num_experts
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), ELEMENTS_PER_PROGRAM // block_e))
    _router_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, router_logits.stride(0), weights, ids, num_tokens, num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl_launch_args(router_logits.device),
    )
    return weights, ids


def select_experts_torch(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in three torch ops (the CPU's path)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int32), largest first: the
    module's docstring. Sync-free (CUDA-graph capturable)."""
    if router_logits.is_cuda:
        return select_experts_triton(router_logits, top_k, renormalize)
    return select_experts_torch(router_logits, top_k, renormalize)


def select_experts_reference(router_logits: torch.Tensor, top_k: int,
                             renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in plain steps: exp(l - max) / sum, experts sorted by probability, the first k."""
    logits = router_logits.float()
    probs = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, order.to(torch.int32)
