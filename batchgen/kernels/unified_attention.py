"""Unified attention: the decode and prefill (extend) sequences of one step in one launch, driven only
by device-side metadata, so that a whole mixed step can be captured in a CUDA graph.

Sequence i owns query rows [q_start[i], q_start[i + 1]) (q_len_i, 0 for padding) at the last q_len_i
positions of its first kv_lens[i] tokens, read through slot(i, p) = req_to_token[seq_rows[i], p];
query j sees positions <= kv_lens[i] - q_len_i + j. GQA: query head h reads KV head h // G.

    o = softmax(q k^T * scale + causal_mask) v

Flash attention in base 2 (the key loop is kernels/prefill_attention.attend_keys). A program owns a
KV head and BLOCK_Q query tokens of one sequence, the G query heads of a token packed into the rows
of one tile (row r: token first_q + r // G, head kv_head * G + r % G), so K/V are read once per KV
head; blocks with at most SMALL_Q tokens left (decodes) take a SMALL_M-row tile. Sequence i's blocks
start at q_start[i] // BLOCK_Q + i (a binary search finds them): the grid comes from T, B and the
shapes only. Rows past q_start[B] (padding) are left unwritten.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchgen.kernels.device import interpreting, pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.kv_dtype import query_for_kv_dot
from batchgen.kernels.prefill_attention import attend_keys


@triton.jit
def _attend_query_block(
    q_ptr,  # [T, Hq, D] packed queries
    q_stride_t,  # elements between two tokens of q
    q_stride_h,  # elements between two heads of q
    k_head_ptr,  # k_cache + kv_head * cache_stride_h
    v_head_ptr,  # v_cache + kv_head * cache_stride_h
    cache_stride_s,  # elements between two slots of either cache
    out_ptr,  # [T, Hq, D]
    out_stride_t,  # elements between two tokens of out
    out_stride_h,  # elements between two heads of out
    token_row,  # pointer to this sequence's row of req_to_token
    kv_head,  # int64 KV head of this program
    q_first,  # int64 packed row of the sequence's first query
    first_q,  # int64 index (within the sequence) of this block's first query
    q_len,  # queries of the sequence
    kv_len,  # context length, new tokens included
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # G = Hq / Hk
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_M: tl.constexpr,  # rows of the tile, a power of 2 >= BLOCK_Q * G
    BLOCK_Q: tl.constexpr,  # query tokens of the block
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # next power of 2 >= D (and >= 16)
    DOT_PRECISION: tl.constexpr,
    INVARIANT: tl.constexpr,
    ROW_EXACT: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP  # query index within the sequence
    heads = kv_head * GROUP + rows % GROUP  # query head of each row
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    io_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + (q_first + q_idx)[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q = query_for_kv_dot(q, k_head_ptr.dtype.element_ty)  # attend_keys widens K/V to q's dtype
    prefix = kv_len - q_len  # cached tokens before the first new one
    q_pos = prefix + q_idx  # absolute position of each row's query (padding rows: past the block)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, full_end) are seen by every row: no causal mask there; then the blocks on the
    # diagonal up to the block's last query. Every row sees key 0 (q_pos >= 0), so whichever phase
    # runs first leaves m_i finite.
    full_end = (prefix + first_q + 1) // BLOCK_N * BLOCK_N
    if INVARIANT:  # every block through the one masked loop, whose code is the same for every query
        full_end = 0
    kv_end = tl.minimum(kv_len, prefix + first_q + BLOCK_Q)
    acc, l_i, m_i = attend_keys(
        acc, l_i, m_i, q, q_pos, token_row, k_head_ptr, v_head_ptr, cache_stride_s,
        0, full_end, qk_scale, False, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, ROW_EXACT,
    )
    acc, l_i, m_i = attend_keys(
        acc, l_i, m_i, q, q_pos, token_row, k_head_ptr, v_head_ptr, cache_stride_s,
        full_end, kv_end, qk_scale, True, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, ROW_EXACT,
    )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_first + q_idx)[:, None] * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# One compile for every batch size; index arrays not specialized on alignment (kernels/__init__.py).
@triton.jit(do_not_specialize=["num_seqs", "search_steps"],
            do_not_specialize_on_alignment=["seq_rows_ptr", "q_start_ptr", "kv_lens_ptr"])
def _unified_attention_kernel(
    q_ptr,  # [T, Hq, D] packed queries (may be a slice of the fused qkv output)
    q_stride_t,  # elements between two tokens of q
    q_stride_h,  # elements between two heads of q
    k_cache_ptr,  # [num_slots, Hk, D]
    v_cache_ptr,  # [num_slots, Hk, D]
    cache_stride_s,  # elements between two slots of either cache
    cache_stride_h,  # elements between two heads of either cache
    out_ptr,  # [T, Hq, D]
    out_stride_t,  # elements between two tokens of out
    out_stride_h,  # elements between two heads of out
    req_to_token_ptr,  # [rows, max_len] int32 slot of each (request row, position)
    req_to_token_stride,  # elements between two rows of req_to_token
    seq_rows_ptr,  # [B] int32 row of each sequence in req_to_token
    q_start_ptr,  # [B + 1] int32 cumulative query counts, q_start[0] == 0
    kv_lens_ptr,  # [B] int32 context length of each sequence (cached + new)
    num_seqs,  # B
    search_steps,  # ceil(log2(B + 1)), the binary search's steps
    qk_scale,  # softmax scale * log2(e)
    NUM_KV_HEADS: tl.constexpr,  # Hk
    GROUP: tl.constexpr,  # G = Hq / Hk
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_M: tl.constexpr,  # rows of the large tile
    BLOCK_Q: tl.constexpr,  # query tokens of a q block: BLOCK_M // G
    SMALL_M: tl.constexpr,  # rows of the small tile (== BLOCK_M: no smaller tile)
    SMALL_Q: tl.constexpr,  # query tokens the small tile holds: SMALL_M // G
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # next power of 2 >= D (and >= 16)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (then unused)
    INVARIANT: tl.constexpr,  # batch_invariant (unified_attention_triton)
    ROW_EXACT: tl.constexpr,  # the interpreter: products through device.exact_dot (prefill_attention.attend_keys)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)
    # The KV heads of one q block run side by side: they read neighbouring bytes of the same slots.
    program = tl.program_id(0)
    block = program // NUM_KV_HEADS  # q block, int32 like q_start
    kv_head = (program % NUM_KV_HEADS).to(tl.int64)
    # The sequence: the largest i in [0, B] with q_start[i] // BLOCK_Q + i <= block. lo <= hi
    # throughout (i = 0 always qualifies), so mid stays in [0, B].
    lo = block * 0
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        fits = tl.load(q_start_ptr + mid) // BLOCK_Q + mid <= block
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    seq = lo.to(tl.int64)
    if seq >= num_seqs:  # past the last sequence's blocks
        return
    q_first = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_first
    first_q = ((block - (q_first // BLOCK_Q + seq)) * BLOCK_Q).to(tl.int64)
    if first_q >= q_len:  # the sequence's spare block, or a padding sequence
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    token_row = req_to_token_ptr + tl.load(seq_rows_ptr + seq).to(tl.int64) * req_to_token_stride
    k_head_ptr = k_cache_ptr + kv_head * cache_stride_h
    v_head_ptr = v_cache_ptr + kv_head * cache_stride_h
    q_first = q_first.to(tl.int64)
    if q_len - first_q <= SMALL_Q:
        _attend_query_block(
            q_ptr, q_stride_t, q_stride_h, k_head_ptr, v_head_ptr, cache_stride_s,
            out_ptr, out_stride_t, out_stride_h, token_row, kv_head, q_first, first_q, q_len, kv_len,
            qk_scale, GROUP, HEAD_DIM, SMALL_M, SMALL_Q, BLOCK_N, BLOCK_D, DOT_PRECISION, INVARIANT,
            ROW_EXACT,
        )
    else:
        _attend_query_block(
            q_ptr, q_stride_t, q_stride_h, k_head_ptr, v_head_ptr, cache_stride_s,
            out_ptr, out_stride_t, out_stride_h, token_row, kv_head, q_first, first_q, q_len, kv_len,
            qk_scale, GROUP, HEAD_DIM, BLOCK_M, BLOCK_Q, BLOCK_N, BLOCK_D, DOT_PRECISION, INVARIANT,
            ROW_EXACT,
        )


def _pick_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, SMALL_M, BLOCK_N, num_warps, num_stages) before rounding to the group size. 16-bit
    inputs with head_dim <= 128 take the prefill kernel's tile (64 x 64) and a 16-row tile for decodes
    (the decode kernel's); fp32 and head_dim > 128 take small tiles."""
    if dtype == torch.float32 or head_dim > 128:
        return 32, 16, 32, 4, 1
    return 64, 16, 64, 4, 3


def _unified_attention_launch(
    q, k_cache, v_cache, req_to_token, seq_rows, q_start, kv_lens, scale,
    block_m, small_m, block_n, num_warps, num_stages, invariant=False,
):
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_rows.shape[0]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads and k_cache.shape[2] == head_dim
    assert q_start.shape == (num_seqs + 1,) and kv_lens.shape == (num_seqs,)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
    assert req_to_token.stride(1) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    # A tile holds at least one token's G heads; the small tile is no larger than the large one.
    block_m = max(block_m, triton.next_power_of_2(group))
    small_m = min(max(small_m, triton.next_power_of_2(group)), block_m)
    block_q = block_m // group
    grid = ((num_tokens // block_q + num_seqs) * num_kv_heads,)
    _unified_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        out, out.stride(0), out.stride(1),
        req_to_token, req_to_token.stride(0),
        seq_rows, q_start, kv_lens,
        num_seqs,
        num_seqs.bit_length(),
        scale * math.log2(math.e),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        SMALL_M=small_m,
        SMALL_Q=small_m // group,
        BLOCK_N=block_n,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INVARIANT=invariant,
        ROW_EXACT=invariant and interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_args(q.device),
    )
    return out


def unified_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_rows: torch.Tensor,
    q_start: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """batch_invariant: one tile for every query (the decodes' small one: decodes are most of a batch
    job's attention) and every key block through the masked loop, so a query's bits depend on its
    sequence alone: its keys are read in BLOCK_N steps from position 0 by the same code whatever else
    the launch holds, however the prompt was chunked (a block masked whole adds exactly nothing)."""
    block_m, small_m, block_n, num_warps, num_stages = _pick_config(q.shape[2], q.dtype)
    if batch_invariant:
        block_m = small_m
    return _unified_attention_launch(
        q, k_cache, v_cache, req_to_token, seq_rows, q_start, kv_lens, scale, block_m, small_m, block_n,
        num_warps, num_stages, invariant=batch_invariant,
    )


def unified_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_rows: torch.Tensor,
    q_start: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence at a time, in fp32: SDPA with the causal mask of the chunk's positions. Rows
    past q_start[B] come out as zeros."""
    out = torch.zeros_like(q)
    starts, rows, lens = q_start.tolist(), seq_rows.tolist(), kv_lens.tolist()
    for i, (row, kv_len) in enumerate(zip(rows, lens)):
        start, end = starts[i], starts[i + 1]
        if end == start:  # a padding sequence
            continue
        slots = req_to_token[row, :kv_len].long()
        qi = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        ki = k_cache[slots].float().transpose(0, 1)  # [Hk, kv_len, D]
        vi = v_cache[slots].float().transpose(0, 1)
        q_pos = torch.arange(kv_len - (end - start), kv_len, device=q.device)
        mask = q_pos[:, None] >= torch.arange(kv_len, device=q.device)[None, :]  # [q_len, kv_len]
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=qi.shape[0] != ki.shape[0]
        )
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_rows: torch.Tensor,
    q_start: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """q: [T, Hq, D] (stride(2) == 1); k_cache, v_cache: [num_slots, Hk, D]; req_to_token:
    [rows, max_len] int32; seq_rows, kv_lens: [B] int32; q_start: [B + 1] int32 cumulative, from 0,
    q_start[B] <= T -> o: [T, Hq, D], rows past q_start[B] unspecified. batch_invariant: see
    unified_attention_triton."""
    if q.is_cuda:
        return unified_attention_triton(q, k_cache, v_cache, req_to_token, seq_rows, q_start, kv_lens, scale,
                                        batch_invariant)
    return unified_attention_ref(q, k_cache, v_cache, req_to_token, seq_rows, q_start, kv_lens, scale)
