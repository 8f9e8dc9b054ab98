"""Decode attention: one new query token per sequence against its whole cached context, read
through the token table (slot(i, p) = req_to_token[req_rows[i], p], p < kv_lens[i]; the new
token's own K/V is already stored). GQA: query head h reads KV head h // (Hq / Hk).

    o_i = softmax(q_i K_i^T * scale) V_i

Flash-decoding in two launches. Stage 1: program (kv head, c, j) takes split c of S_i =
ceil(kv_lens[i] / C) keys (rounded up to BLOCK_N) of sequence i = schedule[0, j] (longest context
first: kernels/longest_first.py), all G = Hq / Hk query heads at once, and writes, with
s = q.k * scale * log2(e),
    lse_c = m_c + log2(sum_{p in c} 2^(s_p - m_c)),   o_c = sum_{p in c} 2^(s_p - lse_c) v_p
Stage 2: program (i, q head) merges the splits: o = sum_c 2^(lse_c - lse) o_c, lse = log2(sum_c 2^lse_c).
With C = 1 stage 1 writes o itself. kv_lens[i] == 0 gives o = 0. The grid comes from host ints only.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchgen.kernels.device import (
    let_next_kernel_start,
    num_sms,
    pdl_launch_args,
    wait_for_prior_kernels,
    wait_only_for_prior_kernels,
)
from batchgen.kernels.kv_dtype import query_for_kv_dot
from batchgen.kernels.longest_first import longest_first


# num_splits follows the batch and its lengths, index arrays are views: neither specialized (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_splits"],
            do_not_specialize_on_alignment=["req_rows_ptr", "kv_lens_ptr", "schedule_ptr"])
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D] (may be a slice of the fused qkv output)
    q_stride_b,  # elements between two sequences of q
    q_stride_h,  # elements between two heads of q
    k_cache_ptr,  # [num_slots, Hk, D]
    v_cache_ptr,  # [num_slots, Hk, D]
    cache_stride_s,  # elements between two slots of either cache
    cache_stride_h,  # elements between two heads of either cache
    req_to_token_ptr,  # [rows, max_len] int32 slot of each (request row, position)
    req_to_token_stride,  # elements between two rows of req_to_token
    req_rows_ptr,  # [B] int32 row of each sequence in req_to_token
    kv_lens_ptr,  # [B] int32 context length of each sequence
    schedule_ptr,  # [3, B] int32 (SCHEDULED): sequences, kv_lens, rows in program order (kernels/longest_first.py)
    part_o_ptr,  # [B, Hq, C, D] fp32 o_c of each split (contiguous)
    part_lse_ptr,  # [B, Hq, C] fp32 lse_c of each split (contiguous)
    out_ptr,  # [B, Hq, D] the output, written here when C == 1
    out_stride_b,  # elements between two sequences of out
    out_stride_h,  # elements between two heads of out
    num_q_heads,  # Hq
    num_splits,  # C, the most splits of one sequence
    qk_scale,  # softmax scale * log2(e)
    DIRECT: tl.constexpr,  # C == 1: o = o_0, stored in out (no merge launch, no fp32 round trip)
    SCHEDULED: tl.constexpr,  # programs take sequences in the schedule's order, else in index order
    GROUP: tl.constexpr,  # G = Hq / Hk
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_G: tl.constexpr,  # next power of 2 >= G, at least 16 (the smallest tl.dot tile)
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # next power of 2 >= D, at least 16
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (then unused)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_only_for_prior_kernels(PDL)  # (the next kernel starts as the programs finish reading: below)
    # The kv heads of one (sequence, split) run side by side: they read neighbouring bytes of
    # the same slots.
    kv_head = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    if SCHEDULED:  # (three independent loads: no latency for the index before the others)
        num_seqs = tl.num_programs(2)
        seq = tl.load(schedule_ptr + tl.program_id(2)).to(tl.int64)
        kv_len = tl.load(schedule_ptr + num_seqs + tl.program_id(2))
        req_row = tl.load(schedule_ptr + 2 * num_seqs + tl.program_id(2))
    else:
        seq = tl.program_id(2).to(tl.int64)
        kv_len = tl.load(kv_lens_ptr + seq)
        req_row = tl.load(req_rows_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N  # S_i
    split_start = split * split_len
    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    group_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + group  # query heads of this kv head
    out_ptrs = out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :]
    out_mask = group_mask[:, None] & dim_mask[None, :]
    if split_start >= kv_len:
        if DIRECT:  # empty context (the only split starts past it): o = 0
            tl.store(out_ptrs, tl.zeros([BLOCK_G, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return
    split_end = tl.minimum(split_start + split_len, kv_len)
    token_row = req_to_token_ptr + req_row.to(tl.int64) * req_to_token_stride
    q = tl.load(
        q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    q = query_for_kv_dot(q, k_cache_ptr.dtype.element_ty)  # K/V are widened to q's dtype

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # The first block holds the split's first key (< kv_len), so m_i is finite after it.
    for start_n in range(split_start, split_end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # key positions
        col_mask = cols < split_end
        slots = tl.load(token_row + cols, mask=col_mask, other=0).to(tl.int64)
        kv_offs = slots[:, None] * cache_stride_s + kv_head * cache_stride_h + dims[None, :]
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        s = tl.where(col_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    let_next_kernel_start(PDL)
    if DIRECT:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * num_q_heads + heads) * num_splits + split  # row of [B * Hq * C]
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=group_mask)
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None], mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["kv_lens_ptr"])
def _decode_merge_kernel(
    part_o_ptr,  # [B, Hq, C, D] fp32 o_c of each split (contiguous)
    part_lse_ptr,  # [B, Hq, C] fp32 lse_c of each split (contiguous)
    kv_lens_ptr,  # [B] int32 context length of each sequence
    out_ptr,  # [B, Hq, D]
    out_stride_b,  # elements between two sequences of out
    out_stride_h,  # elements between two heads of out
    num_q_heads,  # Hq
    num_splits,  # C
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_N: tl.constexpr,  # keys per step of stage 1 (S_i is a multiple of it)
    BLOCK_D: tl.constexpr,  # next power of 2 >= D
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    used_splits = tl.cdiv(kv_len, split_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    part = (seq * num_q_heads + head) * num_splits  # first split of this (sequence, head)

    out_ptrs = out_ptr + seq * out_stride_b + head * out_stride_h + dims
    if used_splits == 0:  # empty context: no split wrote anything
        tl.store(out_ptrs, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=dim_mask)
        return
    # Start from split 0 and fold in the others.
    lse = tl.load(part_lse_ptr + part)  # log2 of the sum of weights so far
    acc = tl.load(part_o_ptr + part * HEAD_DIM + dims, mask=dim_mask, other=0.0)
    for c in range(1, used_splits):
        lse_c = tl.load(part_lse_ptr + part + c)
        o_c = tl.load(part_o_ptr + (part + c) * HEAD_DIM + dims, mask=dim_mask, other=0.0)
        m = tl.maximum(lse, lse_c)
        lse_new = m + tl.log2(tl.exp2(lse - m) + tl.exp2(lse_c - m))
        acc = acc * tl.exp2(lse - lse_new) + o_c * tl.exp2(lse_c - lse_new)
        lse = lse_new
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=dim_mask)


# (BLOCK_N, warps, stages) for 16-bit queries; fp32 and head_dim > 128 take small tiles that fit anywhere.
# Head_dim 64 with many programs an SM: smaller tiles, more of them resident, then one warp a program.
TILE_HEAD_DIM_64 = (128, 4, 3)
TILE_HEAD_DIM_64_DENSE = (64, 2, 3)
TILE_HEAD_DIM_64_DENSEST = (64, 1, 3)
DENSE_PROGRAMS_PER_SM = 8
DENSEST_PROGRAMS_PER_SM = 12
TILE_HEAD_DIM_128 = (64, 4, 3)
# Head_dim 128 with few programs an SM (a GPU's share of a few KV heads under TP, a batch's tail): longer steps
# of keys in fewer stages keep more of each program's loads in flight (benchmarks/KERNELS.md).
TILE_HEAD_DIM_128_SPARSE = (128, 4, 2)
SPARSE_PROGRAMS_PER_SM = 6
TILE_SMALL = (32, 4, 1)
# An fp8 pool halves the bytes a key but not the math, which a 4-warp program no longer hides under the loads
# (its softmax reduces across warps): with many programs (one split each), one warp a program; with few, the
# 16-bit pool's tiles (fit on an H200 at W-offline's steps: benchmarks/KERNELS.md).
TILE_FP8_POOL_DENSE = (64, 1, 3)
FP8_POOL_DENSE_PROGRAMS_PER_SM = 6


def pick_tile(dtype: torch.dtype, head_dim: int, programs: int, sms: int,
              pool_dtype: torch.dtype | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) for queries of this dtype and head_dim over a pool of pool_dtype
    (None: the queries' dtype), at `programs` = sequences x kv heads (programs before any split)."""
    if dtype == torch.float32 or head_dim > 128:
        return TILE_SMALL
    if pool_dtype == torch.float8_e4m3fn and programs >= FP8_POOL_DENSE_PROGRAMS_PER_SM * sms:
        return TILE_FP8_POOL_DENSE
    if head_dim > 64:
        sparse = programs < SPARSE_PROGRAMS_PER_SM * sms and pool_dtype != torch.float8_e4m3fn
        return TILE_HEAD_DIM_128_SPARSE if sparse else TILE_HEAD_DIM_128
    if programs >= DENSEST_PROGRAMS_PER_SM * sms:
        return TILE_HEAD_DIM_64_DENSEST
    return TILE_HEAD_DIM_64_DENSE if programs >= DENSE_PROGRAMS_PER_SM * sms else TILE_HEAD_DIM_64


def dense_tile_batch_sizes(num_kv_heads: int, sms: int, pool_dtype: torch.dtype | None = None,
                           head_dim: int = 64) -> list[int]:
    """The fewest sequences at which pick_tile takes each of its tiles for many programs (16-bit queries:
    head_dim 64's two, head_dim 128's one; any head_dim over an fp8 pool): warm-up runs a decode step of
    each size a job can reach."""
    per_sms = [DENSE_PROGRAMS_PER_SM, DENSEST_PROGRAMS_PER_SM] if head_dim <= 64 else [SPARSE_PROGRAMS_PER_SM]
    if pool_dtype == torch.float8_e4m3fn:  # (the fp8 dense tile comes first and takes over the others)
        per_sms = [FP8_POOL_DENSE_PROGRAMS_PER_SM]
    return [triton.cdiv(per_sm * sms, num_kv_heads) for per_sm in per_sms]


def pick_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_n: int, sms: int,
                    per_sm: int = 2) -> int:
    """Fewest splits that give about per_sm programs an SM, and no more than max_kv_len has blocks."""
    splits = min(triton.cdiv(per_sm * sms, num_seqs * num_kv_heads), triton.cdiv(max_kv_len, block_n))
    return max(splits, 1)


def _decode_attention_launch(
    q, k_cache, v_cache, req_to_token, req_rows, kv_lens, max_kv_len, scale,
    num_splits, block_n, num_warps, num_stages, schedule=None,
):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads and k_cache.shape[2] == head_dim
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
    assert req_to_token.stride(1) == 1 and num_splits >= 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    direct = num_splits == 1
    f32 = dict(dtype=torch.float32, device=q.device)
    part_o = torch.empty((num_seqs, num_q_heads, 0 if direct else num_splits, head_dim), **f32)
    part_lse = torch.empty((num_seqs, num_q_heads, 0 if direct else num_splits), **f32)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    scheduled = num_seqs > 1  # (one sequence: nothing to order)
    if scheduled and schedule is None:
        schedule = longest_first(kv_lens, req_rows)
    assert not scheduled or (schedule.shape == (3, num_seqs) and schedule.is_contiguous())
    pdl = pdl_launch_args(q.device)
    _decode_split_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        req_to_token, req_to_token.stride(0),
        req_rows, kv_lens, schedule if scheduled else kv_lens,
        part_o, part_lse,
        out, out.stride(0), out.stride(1),
        num_q_heads, num_splits,
        scale * math.log2(math.e),
        DIRECT=direct,
        SCHEDULED=scheduled,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(triton.next_power_of_2(group), 16),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    if direct:
        return out
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        part_o, part_lse, kv_lens,
        out, out.stride(0), out.stride(1),
        num_q_heads, num_splits,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
        **pdl,
    )
    return out


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    scale: float,
    schedule: torch.Tensor | None = None,
) -> torch.Tensor:
    head_dim = q.shape[2]
    sms = num_sms(q.device) if q.is_cuda else 4
    block_n, num_warps, num_stages = pick_tile(q.dtype, head_dim, q.shape[0] * k_cache.shape[1], sms, k_cache.dtype)
    num_splits = pick_num_splits(q.shape[0], k_cache.shape[1], max_kv_len, block_n, sms)
    return _decode_attention_launch(
        q, k_cache, v_cache, req_to_token, req_rows, kv_lens, max_kv_len, scale,
        num_splits, block_n, num_warps, num_stages, schedule,
    )


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    # Pad every context to max_kv_len; padded positions read slot 0 and are masked out.
    positions = torch.arange(max_kv_len, device=q.device)
    valid = positions[None, :] < kv_lens[:, None].long()  # [B, L]
    slots = torch.where(valid, req_to_token[req_rows.long(), :max_kv_len].long(), 0)
    k = k_cache[slots].to(q.dtype).transpose(1, 2)  # [B, Hk, L, D]
    v = v_cache[slots].to(q.dtype).transpose(1, 2)
    # torch's fused attention accumulates in fp32 for 16-bit inputs
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=group > 1
    )  # [B, Hq, 1, D]
    return out.view(num_seqs, num_q_heads, head_dim)


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    scale: float,
) -> torch.Tensor:
    """The CPU path: the reference's math as two batched matrix products per step over each
    sequence's gathered keys and values as they lie, [L, Hk D], with no copy into a per-head layout.
    The queries enter block-diagonally, [Hq, Hk D] with zeros outside each head's own KV head, so
    the scores' dots are the plain ones (the zeros add nothing); the output keeps each head's own
    block. SDPA's CPU kernel spends ~8x longer on these one-query problems. Scores come out of the
    product in q's dtype and are softmaxed in fp32 (as HF's eager attention does)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    valid = torch.arange(max_kv_len, device=q.device)[None, :] < kv_lens[:, None]  # [B, L]
    slots = req_to_token[:, :max_kv_len].index_select(0, req_rows.long()).long().masked_fill_(~valid, 0)
    shape = (num_seqs, max_kv_len, num_kv_heads * head_dim)
    k = k_cache.index_select(0, slots.view(-1)).view(shape).to(q.dtype)  # [B, L, Hk D]
    v = v_cache.index_select(0, slots.view(-1)).view(shape).to(q.dtype)
    q_blocks = q.new_zeros(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)  # [B, Hk, G, Hk, D]
    # (the diagonal over the two Hk dims is [B, G, D, Hk])
    q_blocks.diagonal(dim1=1, dim2=3).copy_(q.view(num_seqs, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    scores = torch.bmm(q_blocks.view(num_seqs, num_q_heads, -1), k.transpose(1, 2))  # [B, Hq, L]
    scores = scores.float().mul_(scale).masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.bmm(probs, v).view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    # (contiguous: where each KV head serves one query head the permuted diagonal reshapes to a strided
    # view, and callers view the result)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).contiguous().view(num_seqs, num_q_heads, head_dim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    scale: float,
    schedule: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hk, D]; req_to_token: [rows, max_len] int32;
    req_rows, kv_lens: [B] int32; max_kv_len: an upper bound of kv_lens -> o: [B, Hq, D].
    schedule: longest_first(kv_lens, req_rows) when the caller has it (one a step for every layer),
    else made here."""
    if q.is_cuda:
        return decode_attention_triton(
            q, k_cache, v_cache, req_to_token, req_rows, kv_lens, max_kv_len, scale, schedule
        )
    return decode_attention_cpu(q, k_cache, v_cache, req_to_token, req_rows, kv_lens, max_kv_len, scale)
