"""A mixture-of-experts MLP: each token's top-k experts, each a SiLU-gated MLP, summed with the
router's weights.

    out[t] = sum_j w[t, j] * (silu(x[t] Wg_e^T) * (x[t] Wu_e^T)) Wd_e^T,   e = topk_ids[t, j]
    w13 [E, 2I, H] = [Wg_e; Wu_e] of each expert, w2 [E, H, I] = Wd_e

The (token, choice) pairs are grouped by expert in blocks of BLOCK_M slots (kernels/moe_align.py), so
two grouped products take a block of one expert's pairs against that expert's weights:
  1. `_gate_up_kernel`: h[p] = silu(x[t] Wg^T) * (x[t] Wu^T) for pair p = t * k + j, a gate and an up
     accumulator a program (gate and up rounded to x's dtype, as tile_gemm's SILU_MUL_OUT), [T*k, I];
  2. `_down_kernel`: y[p] = w[p] * (h[p] Wd^T) in x's dtype, [T*k, H];
  3. out = y.view(T, k, H).sum(1): one torch reduction (fp32 sums). No atomics anywhere: the same
     inputs give the same bits, and a token's sums do not depend on where its pairs sit in a block.
FP8 experts (`Fp8Experts`): w13 and w2 in e4m3 with fp32 scales per output channel or per 128x128
block; each product's input rows are rounded to e4m3 first (per token, or per group of 128 columns:
kernels/e4m3.py), and the dots run fp8 x fp8 -> fp32, each K step's added to the fp32 sum (Hopper's fp8
tensor cores sum a long K in reduced precision), scaled at the end (channels) or at each step (blocks:
BLOCK_K divides 128, so a step lies in one group). The rounding is the dense fp8 products' (kernels/fp8_gemm.py).

Expert parallelism (layers/moe.py): w13 and w2 hold the rank's experts first_expert .. first_expert + E - 1
of the model's routed_experts, whole; the align gives other ranks' pairs no slot, and step 3 sums each
token's kept pairs only (kernels/moe_sum.py), so each rank's out is a partial sum over the ranks.

A block reads its expert's weight tile once for all its slots; at decode (a few pairs an expert,
16- or 32-slot blocks) each touched expert's weights are streamed about once. Block sizes:
kernels/moe_config.py. Nothing is read back to the host: the whole layer is CUDA-graph capturable.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.e4m3 import FP8, GROUP, dequantize_weight_ref, quantize_weight_ref, round_ref
from batchgen.kernels.fp8_gemm import quantize
from batchgen.kernels.moe_align import local_expert_ids, moe_align
from batchgen.kernels.moe_config import GemmTile, MoeConfig, pick_config
from batchgen.kernels.moe_sum import sum_kept_pairs


class Fp8Experts(NamedTuple):
    """FP8 experts: w13_scale per output channel [E, 2I] and w2_scale [E, H], or per 128x128 block
    [E, 2 * ceil(I/128), ceil(H/128)] (the gate's block rows, then the up's) and [E, ceil(H/128), ceil(I/128)];
    None where the weights were dequantized at load (the CPU), whose inputs are still rounded. block: scales
    by block and inputs rounded per group of 128 columns, else per channel and per token."""
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    block: bool

    @property
    def form(self) -> str:
        """The kernels' SCALES and pick_config's fp8 form."""
        return "block" if self.block else "channel"

    def up_scale_row(self, inter: int) -> int:
        """w13_scale's first row of the up half (the gate half's rows: a channel or a 128-block each)."""
        return triton.cdiv(inter, GROUP) if self.block else inter

    @property
    def group(self) -> int | None:
        """The columns an input's rounding scale covers (kernels/e4m3.py): a group of 128, or the whole row."""
        return GROUP if self.block else None

    @staticmethod
    def scale_shapes(num_experts: int, hidden: int, inter: int, block: bool) -> tuple[tuple[int, ...], ...]:
        """(w13_scale's shape, w2_scale's shape): the class docstring's grids."""
        if not block:
            return (num_experts, 2 * inter), (num_experts, hidden)
        inter_blocks, hidden_blocks = triton.cdiv(inter, GROUP), triton.cdiv(hidden, GROUP)
        return (num_experts, 2 * inter_blocks, hidden_blocks), (num_experts, hidden_blocks, inter_blocks)


GROUP_M = tl.constexpr(8)  # blocks whose column tiles run together (_program_tile)
SCALE_GROUP = tl.constexpr(GROUP)  # columns a block scale (and an input's group scale) covers

@triton.jit
def _program_tile(max_blocks, num_cols, BLOCK_N: tl.constexpr):
    """This program's (block, column tile): the column tiles of GROUP_M blocks together, blocks fastest
    within a group, so programs running side by side share the blocks' rows and the experts' weight
    tiles through the L2."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(num_cols, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_block = pid // per_group * GROUP_M
    group_blocks = tl.minimum(max_blocks - first_block, GROUP_M)
    return first_block + pid % per_group % group_blocks, pid % per_group // group_blocks


@triton.jit
def _block_slots(sorted_ids_ptr, block_expert_ptr, num_padded_ptr, pid_m, BLOCK_M: tl.constexpr):
    """Block pid_m's expert (int64; -1 past the slots in use) and its slots' pairs [BLOCK_M]."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    in_use = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    expert = tl.where(in_use, expert, -1)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.jit
def _load_rows(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of the slots' rows (zeros in padding slots and past the reduction)."""
    if EVEN_K:
        rows = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        rows = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return rows


@triton.jit
def _load_weight(ptrs, k_ok, col_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of an expert's W^T, masked only where K or N is not whole blocks."""
    if EVEN_K and EVEN_N:
        w = tl.load(ptrs)
    elif EVEN_K:
        w = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    elif EVEN_N:
        w = tl.load(ptrs, mask=k_ok[:, None], other=0.0)
    else:
        w = tl.load(ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    return w


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    x_stride_t,  # elements between two tokens of x
    w_ptr,  # [E, 2I, H]: an expert's gate rows [0, I), up rows [I, 2I); H contiguous
    w_stride_e,  # elements between two experts
    w_stride_n,  # elements between two rows of an expert
    h_ptr,  # [T*k, I] out: silu(gate) * up of pair p = t * k + j
    h_stride_p,  # elements between two pairs of h
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 (kernels/moe_align.py)
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,  # T * k: the padding's sentinel
    top_k,
    inter,  # I: columns of h
    hidden,  # H: the reduction
    max_blocks,  # blocks the grid covers (the worst case's)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no reduction masks
    EVEN_N: tl.constexpr,  # inter % BLOCK_N == 0: no column masks on W
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (tf32 would round them to 10 bits)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
    SCALES: tl.constexpr = None,  # e4m3 x and w: "channel" or "block" scales (Fp8Experts)
    x_scale_ptr=None,  # [T, groups] fp32: x's row (or 128-column group) scales
    x_scale_stride_t=0,
    x_scale_stride_g=0,
    w_scale_ptr=None,  # [E, 2I] or [E, 2 * ceil(I/128), ceil(H/128)] fp32 (Fp8Experts.w13_scale)
    w_scale_stride_e=0,
    w_scale_stride_n=0,  # between two channels (or block rows)
    w_scale_stride_k=0,  # between two block columns
    up_scale_row=0,  # the up half's first channel (I) or block row (ceil(I/128))
):
    pid_m, pid_n = _program_tile(max_blocks, inter, BLOCK_N)
    wait_for_prior_kernels(PDL)  # the align wrote the slots (and the rounding x)
    expert, pairs = _block_slots(sorted_ids_ptr, block_expert_ptr, num_padded_ptr, pid_m, BLOCK_M)
    if expert < 0:
        return
    pair_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * x_stride_t + ks[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + inter * w_stride_n
    if SCALES is not None:
        x_scales = x_scale_ptr + tokens * x_scale_stride_t  # [BLOCK_M]
        w_scales = w_scale_ptr + expert * w_scale_stride_e
        gate_rows = cols // SCALE_GROUP if SCALES == "block" else cols  # [BLOCK_N]: the columns' scale rows
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a = _load_rows(x_ptrs, pair_ok, ks < hidden - k0, EVEN_K)
        gate = _load_weight(g_ptrs, ks < hidden - k0, col_ok, EVEN_K, EVEN_N)
        up = _load_weight(u_ptrs, ks < hidden - k0, col_ok, EVEN_K, EVEN_N)
        if SCALES == "block":  # this K step's group: x's scales times each column's block scale
            group = k0 // SCALE_GROUP
            xs = tl.load(x_scales + group * x_scale_stride_g, mask=pair_ok, other=0.0)[:, None]
            gs = tl.load(w_scales + gate_rows * w_scale_stride_n + group * w_scale_stride_k, mask=col_ok, other=0.0)
            us = tl.load(w_scales + (up_scale_row + gate_rows) * w_scale_stride_n + group * w_scale_stride_k,
                         mask=col_ok, other=0.0)
            acc_gate += tl.dot(a, gate) * (xs * gs[None, :])
            acc_up += tl.dot(a, up) * (xs * us[None, :])
        elif SCALES == "channel":  # (a dot a step added in fp32: Hopper's fp8 dots sum a long K imprecisely)
            acc_gate += tl.dot(a, gate)
            acc_up += tl.dot(a, up)
        else:
            acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALES == "channel":
        xs = tl.load(x_scales, mask=pair_ok, other=0.0)[:, None]
        acc_gate *= xs * tl.load(w_scales + gate_rows * w_scale_stride_n, mask=col_ok, other=0.0)[None, :]
        up_scales = tl.load(w_scales + (up_scale_row + gate_rows) * w_scale_stride_n, mask=col_ok, other=0.0)
        acc_up *= xs * up_scales[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * h_stride_p + cols[None, :]
    tl.store(h_ptrs, (gate * tl.sigmoid(gate) * up).to(dtype), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _down_kernel(
    h_ptr,  # [T*k, I]
    h_stride_p,  # elements between two pairs of h
    w_ptr,  # [E, H, I]: I contiguous
    w_stride_e,  # elements between two experts
    w_stride_n,  # elements between two rows of an expert
    y_ptr,  # [T*k, H] out: w[p] * (h[p] Wd^T)
    y_stride_p,  # elements between two pairs of y
    weights_ptr,  # [T*k] fp32 router weights, pair order
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 (kernels/moe_align.py)
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,  # T * k: the padding's sentinel
    hidden,  # H: columns of y
    inter,  # I: the reduction
    max_blocks,  # blocks the grid covers (the worst case's)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0: no reduction masks
    EVEN_N: tl.constexpr,  # hidden % BLOCK_N == 0: no column masks on W
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
    SCALES: tl.constexpr = None,  # e4m3 h and w: "channel" or "block" scales (Fp8Experts)
    h_scale_ptr=None,  # [T*k, groups] fp32: h's row (or 128-column group) scales
    h_scale_stride_p=0,
    h_scale_stride_g=0,
    w_scale_ptr=None,  # [E, H] or [E, ceil(H/128), ceil(I/128)] fp32 (Fp8Experts.w2_scale)
    w_scale_stride_e=0,
    w_scale_stride_n=0,  # between two channels (or block rows)
    w_scale_stride_k=0,  # between two block columns
):
    pid_m, pid_n = _program_tile(max_blocks, hidden, BLOCK_N)
    wait_for_prior_kernels(PDL)  # h is the kernel before's output (its rounding's)
    expert, pairs = _block_slots(sorted_ids_ptr, block_expert_ptr, num_padded_ptr, pid_m, BLOCK_M)
    if expert < 0:
        return
    pair_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * h_stride_p + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]  # [BLOCK_K, BLOCK_N]
    if SCALES is not None:
        h_scales = h_scale_ptr + pairs.to(tl.int64) * h_scale_stride_p  # [BLOCK_M]
        w_scales = w_scale_ptr + expert * w_scale_stride_e
        scale_rows = cols // SCALE_GROUP if SCALES == "block" else cols  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a = _load_rows(h_ptrs, pair_ok, ks < inter - k0, EVEN_K)
        w = _load_weight(w_ptrs, ks < inter - k0, col_ok, EVEN_K, EVEN_N)
        if SCALES == "block":
            group = k0 // SCALE_GROUP
            hs = tl.load(h_scales + group * h_scale_stride_g, mask=pair_ok, other=0.0)[:, None]
            ws = tl.load(w_scales + scale_rows * w_scale_stride_n + group * w_scale_stride_k, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * (hs * ws[None, :])
        elif SCALES == "channel":  # (as in _gate_up_kernel)
            acc += tl.dot(a, w)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALES == "channel":
        acc *= (tl.load(h_scales, mask=pair_ok, other=0.0)[:, None]
                * tl.load(w_scales + scale_rows * w_scale_stride_n, mask=col_ok, other=0.0)[None, :])
    route = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)
    y_ptrs = y_ptr + pairs[:, None].to(tl.int64) * y_stride_p + cols[None, :]
    tl.store(y_ptrs, (acc * route[:, None]).to(y_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (16-bit dots ignore it)


def _check_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fp8: Fp8Experts | None = None) -> None:
    num_experts, two_inter, hidden = w13.shape
    assert x.dim() == 2 and x.shape[1] == hidden and two_inter % 2 == 0
    assert w2.shape == (num_experts, hidden, two_inter // 2)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1, "rows must be contiguous"
    if fp8 is None:
        assert x.dtype == w13.dtype == w2.dtype
        return
    assert w13.dtype == w2.dtype == FP8 and fp8.w13_scale is not None and fp8.w2_scale is not None
    want = Fp8Experts.scale_shapes(num_experts, hidden, two_inter // 2, fp8.block)
    assert (tuple(fp8.w13_scale.shape), tuple(fp8.w2_scale.shape)) == want, "scales of another form"


def _scale_args(fp8: Fp8Experts | None, rows_scale: torch.Tensor | None, weight_scale: torch.Tensor | None,
                rows: str) -> dict:
    """The kernels' scale arguments: the input's scales (named by `rows`: "x" or "h"), the weight's."""
    if fp8 is None:
        return {}
    return {"SCALES": fp8.form, f"{rows}_scale_ptr": rows_scale,
            f"{rows}_scale_stride_{'t' if rows == 'x' else 'p'}": rows_scale.stride(0),
            f"{rows}_scale_stride_g": rows_scale.stride(1), "w_scale_ptr": weight_scale,
            "w_scale_stride_e": weight_scale.stride(0), "w_scale_stride_n": weight_scale.stride(1),
            "w_scale_stride_k": weight_scale.stride(2) if fp8.block else 0}


def gate_up_silu(x: torch.Tensor, w13: torch.Tensor, top_k: int, aligned: tuple[torch.Tensor, ...],
                 block_m: int, tile: GemmTile, fp8: Fp8Experts | None = None,
                 x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Product 1 of the module's docstring: h [T*k, I] in out_dtype (x's by default). With fp8, x is e4m3
    with its scales x_scale [T, groups]."""
    sorted_ids, block_expert, num_padded = aligned
    num_pairs, (_, two_inter, hidden) = x.shape[0] * top_k, w13.shape
    inter = two_inter // 2
    h = torch.empty((num_pairs, inter), dtype=out_dtype or x.dtype, device=x.device)
    max_blocks = block_expert.numel()
    scales = _scale_args(fp8, x_scale, None if fp8 is None else fp8.w13_scale, "x")
    if fp8 is not None:  # (the up half's first scale row)
        scales["up_scale_row"] = fp8.up_scale_row(inter)
    _gate_up_kernel[(max_blocks * triton.cdiv(inter, tile.block_n),)](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), h, h.stride(0),
        sorted_ids, block_expert, num_padded, num_pairs, top_k, inter, hidden, max_blocks,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=hidden % tile.block_k == 0,
        EVEN_N=inter % tile.block_n == 0, DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=tile.warps, num_stages=tile.stages, **pdl_launch_args(x.device), **scales,
    )
    return h


def down_weighted(h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, aligned: tuple[torch.Tensor, ...],
                  block_m: int, tile: GemmTile, fp8: Fp8Experts | None = None,
                  h_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Product 2 of the module's docstring: y [T*k, H] in out_dtype (h's by default), each pair's row times
    its weight. With fp8, h is e4m3 with its scales h_scale [T*k, groups]."""
    sorted_ids, block_expert, num_padded = aligned
    num_pairs, (_, hidden, inter) = h.shape[0], w2.shape
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = torch.empty((num_pairs, hidden), dtype=out_dtype or h.dtype, device=h.device)
    max_blocks = block_expert.numel()
    _down_kernel[(max_blocks * triton.cdiv(hidden, tile.block_n),)](
        h, h.stride(0), w2, w2.stride(0), w2.stride(1), y, y.stride(0), weights,
        sorted_ids, block_expert, num_padded, num_pairs, hidden, inter, max_blocks,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=inter % tile.block_k == 0,
        EVEN_N=hidden % tile.block_n == 0, DOT_PRECISION=_dot_precision(h.dtype),
        num_warps=tile.warps, num_stages=tile.stages, **pdl_launch_args(h.device),
        **_scale_args(fp8, h_scale, None if fp8 is None else fp8.w2_scale, "h"),
    )
    return y


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: MoeConfig | None = None,
                     fp8: Fp8Experts | None = None, out: torch.Tensor | None = None,
                     first_expert: int = 0, routed_experts: int | None = None) -> torch.Tensor:
    """The module's docstring's three steps after the align; config: pick_config's unless given. fp8: w13
    and w2 are e4m3 with these scales, and x and h are rounded to e4m3 before their products. out: where
    the sum over the k goes ([T, H], x's dtype; a new tensor if None). first_expert, routed_experts: w13
    and w2 hold the experts from first_expert of routed_experts (all of them by default)."""
    _check_weights(x, w13, w2, fp8)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    assert x.shape[0] == num_tokens and topk_weights.shape == topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x) if out is None else out
    routed_experts = routed_experts or num_experts
    # (a rank's experts each get the pairs they get on one GPU: the model's shape picks the tiles)
    config = config or pick_config(num_tokens, hidden, two_inter // 2, routed_experts, top_k, x.device, x.dtype,
                                   None if fp8 is None else fp8.form)
    aligned = moe_align(topk_ids, num_experts, config.block_m, first_expert)
    if fp8 is None:
        h = gate_up_silu(x, w13, top_k, aligned, config.block_m, config.gate_up)
        y = down_weighted(h, w2, topk_weights, aligned, config.block_m, config.down)
    else:
        xq, x_scale = quantize(x, group=fp8.group)
        h = gate_up_silu(xq, w13, top_k, aligned, config.block_m, config.gate_up, fp8, x_scale, x.dtype)
        hq, h_scale = quantize(h, group=fp8.group)
        y = down_weighted(hq, w2, topk_weights, aligned, config.block_m, config.down, fp8, h_scale, x.dtype)
    if routed_experts != num_experts:  # (y's rows of other ranks' pairs are unwritten)
        return sum_kept_pairs(y, topk_ids, first_expert, num_experts, out)
    if top_k == 1:
        return y if out is None else out.copy_(y)
    return torch.sum(y.view(num_tokens, top_k, hidden), dim=1, out=out)  # (fp32 sums, rounded once)


def dequantize_experts(w13: torch.Tensor, w2: torch.Tensor, fp8: Fp8Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 experts' e4m3 weights times their scales, fp32, expert by expert (e4m3.dequantize_weight_ref; a
    block grid's gate and up halves each their own grid)."""
    inter = w2.shape[2]
    up_row = fp8.up_scale_row(inter)

    def gate_up(e: int) -> torch.Tensor:
        return torch.cat([dequantize_weight_ref(w13[e, :inter], fp8.w13_scale[e, :up_row]),
                          dequantize_weight_ref(w13[e, inter:], fp8.w13_scale[e, up_row:])])

    return (torch.stack([gate_up(e) for e in range(w13.shape[0])]),
            torch.stack([dequantize_weight_ref(w, scale) for w, scale in zip(w2, fp8.w2_scale)]))


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor, Fp8Experts]:
    """16/32-bit experts in e4m3 with scales per output channel, or per 128x128 block (the gate and up
    halves each their own grid): (w13, w2, their Fp8Experts), as --quantization fp8 and the tests take them."""
    inter = w2.shape[2]

    def each(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K]
        if not block:  # (a row's scale is its own: all experts' rows at once)
            q, s = quantize_weight_ref(w.reshape(-1, w.shape[2]))
            return q.view(w.shape), s.view(w.shape[:2])
        q, s = zip(*(quantize_weight_ref(e, block=True) for e in w))
        return torch.stack(q), torch.stack(s)

    if block:
        (gate, gate_scale), (up, up_scale) = each(w13[:, :inter]), each(w13[:, inter:])
        w13_q, w13_scale = torch.cat([gate, up], dim=1), torch.cat([gate_scale, up_scale], dim=1)
    else:
        w13_q, w13_scale = each(w13)
    w2_q, w2_scale = each(w2)
    return w13_q, w2_q, Fp8Experts(w13_scale, w2_scale, block)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, fp8: Fp8Experts | None = None, first_expert: int = 0) -> torch.Tensor:
    """The definition, in fp32 and rounded where the kernels round (gate and up, silu(gate) * up, each
    pair's weighted output to x's dtype; their sum over the k once). The CPU's path: one pass per expert
    that has pairs (its rows gathered, two products), never per token. fp8: x and h rounded to e4m3 as
    the kernels round them, and the weights dequantized first (unless the scales are None: already).
    first_expert: w13 and w2 hold the experts from this one on; pairs of others add nothing."""
    if fp8 is not None and fp8.w13_scale is not None:
        w13, w2 = dequantize_experts(w13, w2, fp8)

    def rounded(rows: torch.Tensor) -> torch.Tensor:  # (fp32)
        return rows.float() if fp8 is None else round_ref(rows, group=fp8.group)

    num_tokens, k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    flat_ids = local_expert_ids(topk_ids, first_expert, num_experts)  # (others' pairs last)
    order = torch.argsort(flat_ids, stable=True)  # the (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    # (index_copy_ into a row per pair, not index_add_ into a row per token: CPU torch's index_add_ is
    # ~1,000 times slower)
    pairs = torch.zeros(num_tokens * k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate_up = F.linear(rounded(x.index_select(0, tokens[rows])), w13[expert].float()).to(x.dtype).float()
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y = F.linear(rounded(h), w2[expert].float()) * weights[rows, None]
        pairs.index_copy_(0, order[rows], y.to(x.dtype).float())
        start += count
    return pairs.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, fp8: Fp8Experts | None = None, out: torch.Tensor | None = None,
              first_expert: int = 0, routed_experts: int | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k] int32 -> [T, H]
    in x's dtype (written into out where given): the Triton path on a GPU, the reference on CPU. fp8: FP8
    experts (Fp8Experts). first_expert, routed_experts: w13 and w2 hold the experts from first_expert of
    routed_experts (expert parallelism), and the result sums the pairs routed to those alone."""
    if x.is_cuda:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, fp8=fp8, out=out, first_expert=first_expert,
                                routed_experts=routed_experts)
    y = fused_moe_reference(x, w13, w2, topk_weights, topk_ids, fp8, first_expert)
    return y if out is None else out.copy_(y)
