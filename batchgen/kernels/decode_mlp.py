"""A Llama MLP of one row in one launch: add + RMSNorm, gate/up, SiLU-and-mul and down.

    r' = x + r;  n = rmsnorm(r') * w_norm                    (rounded as kernels/rmsnorm.py rounds)
    g, u = n W_gate^T, n W_up^T                              (each rounded to the model's dtype)
    sum += (silu(g) * u) W_down^T                            (fp32; silu(g) * u not rounded)

At one row the three are streams of weights, and a kernel boundary between each is all latency.
Program p owns BLOCK_J rows of the intermediate: it streams its rows of W_gate and W_up (norming x as
it reads), then its rows of W_down^T [I, H] (contiguous, unlike W_down's columns), and adds its [H]
share into `sum` with fp32 atomics (their order varies: about one fp32 rounding). `sum` must be zero
on entry: program 0 zeroes `next_sum`, the next layer's (layers/one_row_mlp.py keeps one a layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.rmsnorm import add_residual, add_rmsnorm_ref


@triton.jit
def _normed(x_ptr, res_ptr, norm_w_ptr, k, rstd):
    """rmsnorm(x + r) * w at columns k, in fp32, rounded as kernels/rmsnorm.py rounds it (unmasked:
    BLOCK_K divides H here)."""
    r = tl.load(res_ptr + k)
    summed = add_residual(tl.load(x_ptr + k), r)
    w = tl.load(norm_w_ptr + k).to(tl.float32)
    return ((summed.to(tl.float32) * rstd).to(r.dtype).to(tl.float32) * w).to(r.dtype).to(tl.float32)


@triton.jit(do_not_specialize=["eps"])
def _decode_mlp_kernel(
    x_ptr,  # [H]: the attention block's output (the model's dtype, or an fp32 sum)
    res_ptr,  # [H] residual
    new_res_ptr,  # [H] x + residual, written by program 0
    norm_w_ptr,  # [H] RMSNorm weight
    eps,
    w_gate_up_ptr,  # [2I, H]: gate rows, then up rows
    w_down_t_ptr,  # [I, H]: W_down transposed
    sum_ptr,  # [H] fp32, zero on entry: the programs add the down product into it
    next_sum_ptr,  # [H] fp32: program 0 zeroes it (see the module's docstring)
    H,
    I,
    BLOCK_J: tl.constexpr,  # rows of the intermediate a program
    BLOCK_K: tl.constexpr,  # columns of W_gate / W_up a chunk (divides H)
    BLOCK_H: tl.constexpr,  # columns of W_down^T a chunk (divides H)
    H_POW2: tl.constexpr,  # H rounded up to a power of two: the row in one load
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    pid = tl.program_id(0)
    j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
    j_row = tl.minimum(j, I - 1).to(tl.int64)  # the last program re-reads row I-1 and drops it
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_gate_up_ptr + j_row[:, None] * H + cols[None, :]
    up_ptrs = w_gate_up_ptr + (j_row + I)[:, None] * H + cols[None, :]
    gate_w = tl.load(gate_ptrs)  # the first chunks before the PDL wait: weights are constants
    up_w = tl.load(up_ptrs)
    wait_for_prior_kernels(PDL)

    # the row's statistics, every program (x and r come from L2), in one load: a loop of loads here
    # would be a chain of L2 round trips before the stream goes on
    h = tl.arange(0, H_POW2)
    h_ok = h < H
    r = tl.load(res_ptr + h, mask=h_ok, other=0.0)
    summed = add_residual(tl.load(x_ptr + h, mask=h_ok, other=0.0), r)
    if pid == 0:
        tl.store(new_res_ptr + h, summed, mask=h_ok)
        tl.store(next_sum_ptr + h, tl.zeros((H_POW2,), dtype=tl.float32), mask=h_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(summed.to(tl.float32) * summed.to(tl.float32), axis=0) / H + eps)

    gate_acc = tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32)  # per lane, summed once at the end
    up_acc = tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32)
    for k0 in range(BLOCK_K, H, BLOCK_K):
        next_gate = tl.load(gate_ptrs + k0)  # in flight while the chunk before is summed
        next_up = tl.load(up_ptrs + k0)
        normed = _normed(x_ptr, res_ptr, norm_w_ptr, k0 - BLOCK_K + cols, rstd)[None, :]
        gate_acc += gate_w.to(tl.float32) * normed
        up_acc += up_w.to(tl.float32) * normed
        gate_w = next_gate
        up_w = next_up
    out_cols = tl.arange(0, BLOCK_H)
    down_ptrs = w_down_t_ptr + j_row[:, None] * H + out_cols[None, :]
    down_w = tl.load(down_ptrs)  # W_down's first chunk in flight while the last gate/up chunk is summed
    normed = _normed(x_ptr, res_ptr, norm_w_ptr, H - BLOCK_K + cols, rstd)[None, :]
    gate_acc += gate_w.to(tl.float32) * normed
    up_acc += up_w.to(tl.float32) * normed
    dtype = gate_w.dtype
    gate = tl.sum(gate_acc, axis=1).to(dtype).to(tl.float32)  # rounded as the gate/up product's output
    up = tl.sum(up_acc, axis=1).to(dtype).to(tl.float32)
    act = tl.where(j < I, gate * tl.sigmoid(gate) * up, 0.0)[:, None]

    for h0 in range(BLOCK_H, H, BLOCK_H):
        next_down = tl.load(down_ptrs + h0)
        part = tl.sum(down_w.to(tl.float32) * act, axis=0)
        tl.atomic_add(sum_ptr + h0 - BLOCK_H + out_cols, part, sem="relaxed")
        down_w = next_down
    tl.atomic_add(sum_ptr + H - BLOCK_H + out_cols, tl.sum(down_w.to(tl.float32) * act, axis=0), sem="relaxed")


Tile = tuple[int, int, int, int]  # (BLOCK_J, BLOCK_K, BLOCK_H, warps)


def default_tile(hidden: int) -> Tile:
    """(BLOCK_J, BLOCK_K, BLOCK_H, warps) for a hidden size H (chunks that divide H)."""
    pow2 = hidden & -hidden  # the largest power of two that divides H
    return (16, min(256, pow2), min(1024, pow2), 4)


def supports(hidden: int) -> bool:
    """Whether the kernel takes a hidden size: its chunks (powers of two of at least 64) divide H."""
    return hidden % 64 == 0


def decode_mlp_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    w_gate_up: torch.Tensor, w_down_t: torch.Tensor, out_sum: torch.Tensor, next_sum: torch.Tensor,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Adds the MLP of rmsnorm(x + residual) to out_sum [1, H] (fp32, zero on entry) and zeroes
    next_sum [1, H]; -> x + residual. x [1, H] (the model's dtype or fp32), residual [1, H],
    w_gate_up [2I, H], w_down_t [I, H] (the down projection's weight, transposed)."""
    inter, hidden = w_down_t.shape
    assert x.shape == residual.shape == (1, hidden) and x.is_contiguous() and residual.is_contiguous()
    assert w_gate_up.shape == (2 * inter, hidden) and w_gate_up.is_contiguous() and w_down_t.is_contiguous()
    assert w_gate_up.dtype == w_down_t.dtype == residual.dtype == norm_weight.dtype and supports(hidden)
    assert out_sum.shape == next_sum.shape == (1, hidden) and out_sum.dtype == next_sum.dtype == torch.float32
    assert out_sum.data_ptr() != next_sum.data_ptr(), "a layer's sum is not the next one's"
    block_j, block_k, block_h, num_warps = tile or default_tile(hidden)
    assert hidden % block_k == 0 and hidden % block_h == 0
    new_residual = torch.empty_like(residual)
    _decode_mlp_kernel[(triton.cdiv(inter, block_j),)](
        x, residual, new_residual, norm_weight, eps, w_gate_up, w_down_t, out_sum, next_sum, hidden, inter,
        BLOCK_J=block_j, BLOCK_K=block_k, BLOCK_H=block_h, H_POW2=triton.next_power_of_2(hidden),
        num_warps=num_warps, num_stages=1, **pdl_launch_args(x.device),
    )
    return new_residual


def decode_mlp_ref(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    w_gate_up: torch.Tensor, w_down_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the MLP's fp32 sum [1, H], x + residual), rounded as the kernel rounds."""
    normed, new_residual = add_rmsnorm_ref(x.to(residual.dtype), residual, norm_weight, eps)
    gate, up = (normed.float() @ w_gate_up.float().t()).to(residual.dtype).float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up) @ w_down_t.float(), new_residual


def decode_mlp(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    w_gate_up: torch.Tensor, w_down_t: torch.Tensor, out_sum: torch.Tensor, next_sum: torch.Tensor,
) -> torch.Tensor:
    """decode_mlp_triton's contract: the kernel on a GPU, the reference's sum added elsewhere."""
    if x.is_cuda:
        return decode_mlp_triton(x, residual, norm_weight, eps, w_gate_up, w_down_t, out_sum, next_sum)
    total, new_residual = decode_mlp_ref(x, residual, norm_weight, eps, w_gate_up, w_down_t)
    out_sum += total
    next_sum.zero_()
    return new_residual
