"""Prefill / extend attention over the packed ("nopad") batch.

Sequence i owns the packed query rows [q_start[i], q_start[i] + q_lens[i]). Its keys and values are
its first kv_lens[i] tokens, cached ones included, read through the token table:
    slot(i, p) = req_to_token[req_rows[i], p],   p < kv_lens[i]
The new tokens sit at the last q_lens[i] positions: query j of the chunk, at position
kv_lens[i] - q_lens[i] + j, attends to positions <= its own. GQA: query head h reads KV head h // (Hq / Hk).

    o = softmax(q k^T * scale + causal_mask) v

Flash attention in base 2: a program owns BLOCK_M query rows of one head of one sequence and keeps
    m = running max of s,  l = sum 2^(s - m),  acc = sum 2^(s - m) v,   s = q.k * scale * log2(e)
over blocks of BLOCK_N keys (l and acc rescaled by 2^(m_old - m_new)); o = acc / l. Only the key
blocks on the diagonal apply the causal mask.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchgen.kernels.device import exact_dot
from batchgen.kernels.kv_dtype import query_for_kv_dot


@triton.jit
def attend_keys(
    acc,  # [BLOCK_M, BLOCK_D] fp32 running sum of 2^(s - m_i) v
    l_i,  # [BLOCK_M] fp32 running sum of 2^(s - m_i)
    m_i,  # [BLOCK_M] fp32 running max of s
    q,  # [BLOCK_M, BLOCK_D]
    q_pos,  # [BLOCK_M] absolute position of each query row
    token_row,  # pointer to this sequence's row of req_to_token
    k_head_ptr,  # k_cache + kv_head * cache_stride_h
    v_head_ptr,  # v_cache + kv_head * cache_stride_h
    cache_stride_s,  # elements between two slots of either cache
    lo,  # first key position, a multiple of BLOCK_N
    hi,  # keys stop before this position
    qk_scale,  # softmax scale * log2(e)
    CAUSAL_MASK: tl.constexpr,  # mask keys after each row's position (blocks on the diagonal)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_EXACT: tl.constexpr = False,  # the interpreter: products through device.exact_dot (batch-invariant mode)
):
    dims = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # key positions
        col_mask = cols < hi
        slots = tl.load(token_row + cols, mask=col_mask, other=0).to(tl.int64)
        kv_offs = slots[:, None] * cache_stride_s + dims[None, :]
        kv_mask = col_mask[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_head_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        if ROW_EXACT:
            s = exact_dot(q, tl.trans(k)) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if CAUSAL_MASK:
            s = tl.where((q_pos[:, None] >= cols[None, :]) & col_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        if ROW_EXACT:
            pv = exact_dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


# index arrays not specialized on alignment (kernels/__init__.py)
@triton.jit(do_not_specialize_on_alignment=["req_rows_ptr", "q_start_ptr", "q_lens_ptr", "kv_lens_ptr"])
def _prefill_attention_kernel(
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
    req_rows_ptr,  # [B] int32 row of each sequence in req_to_token
    q_start_ptr,  # [B] int32 first packed query row of each sequence
    q_lens_ptr,  # [B] int32 new tokens of each sequence
    kv_lens_ptr,  # [B] int32 tokens each sequence attends to (cached + new)
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # Hq / Hk
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # next power of 2 >= D (and >= 16)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (then unused)
):
    block_m = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    q_len = tl.load(q_lens_ptr + seq)
    first_row = block_m * BLOCK_M
    if first_row >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - q_len  # cached tokens before the first new one
    q_first = tl.load(q_start_ptr + seq).to(tl.int64)
    token_row = req_to_token_ptr + tl.load(req_rows_ptr + seq).to(tl.int64) * req_to_token_stride
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)  # query index within the chunk
    dims = tl.arange(0, BLOCK_D)
    io_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + (q_first + rows)[:, None] * q_stride_t + head * q_stride_h + dims[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q = query_for_kv_dot(q, k_cache_ptr.dtype.element_ty)  # attend_keys widens K/V to q's dtype
    q_pos = prefix + rows  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, full_end) are visible to every row of the block: no causal mask there. Then the
    # blocks on the diagonal, up to the last row's position. Either the first phase runs or the
    # second starts at key 0, which every row sees: m_i is finite after the first block, so
    # 2^(m_i - m_new) never meets -inf - -inf.
    full_end = (prefix + first_row + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(kv_len, prefix + first_row + BLOCK_M)
    k_head_ptr = k_cache_ptr + kv_head * cache_stride_h
    v_head_ptr = v_cache_ptr + kv_head * cache_stride_h
    acc, l_i, m_i = attend_keys(
        acc, l_i, m_i, q, q_pos, token_row, k_head_ptr, v_head_ptr, cache_stride_s,
        0, full_end, qk_scale, False, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
    )
    acc, l_i, m_i = attend_keys(
        acc, l_i, m_i, q, q_pos, token_row, k_head_ptr, v_head_ptr, cache_stride_s,
        full_end, kv_end, qk_scale, True, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
    )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_first + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _pick_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): tuned for 16-bit inputs with head_dim <= 128; fp32
    and head_dim > 128 take small tiles."""
    if dtype == torch.float32 or head_dim > 128:
        return (64, 32, 4, 1) if head_dim <= 128 else (32, 32, 4, 1)
    return 64, 64, 4, 3


def _prefill_attention_launch(
    q, k_cache, v_cache, req_to_token, req_rows, q_start, q_lens, kv_lens, max_q_len, scale,
    block_m, block_n, num_warps, num_stages,
):
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = req_rows.shape[0]
    num_kv_heads = k_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[2] == head_dim
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
    assert req_to_token.stride(1) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0 or max_q_len == 0:
        return out
    grid = (triton.cdiv(max_q_len, block_m), num_q_heads, num_seqs)
    _prefill_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        out, out.stride(0), out.stride(1),
        req_to_token, req_to_token.stride(0),
        req_rows, q_start, q_lens, kv_lens,
        scale * math.log2(math.e),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    config = _pick_config(q.shape[2], q.dtype)
    return _prefill_attention_launch(
        q, k_cache, v_cache, req_to_token, req_rows, q_start, q_lens, kv_lens, max_q_len, scale,
        *config,
    )


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    rows, starts, q_list, kv_list = (t.tolist() for t in (req_rows, q_start, q_lens, kv_lens))
    max_kv_len = max(kv_list, default=0)
    if len(rows) > 1 and len(rows) * q.shape[1] * max_q_len * max_kv_len <= 2**24:
        return _padded_prefill(q, k_cache, v_cache, req_to_token, rows, starts, q_list, kv_list, max_q_len, scale)
    out = torch.empty_like(q)
    for row, start, q_len, kv_len in zip(rows, starts, q_list, kv_list):
        slots = req_to_token[row, :kv_len].long()
        qi = q[start : start + q_len].float().transpose(0, 1)  # [Hq, q_len, D]
        ki = k_cache[slots].float().transpose(0, 1)  # [Hk, kv_len, D]
        vi = v_cache[slots].float().transpose(0, 1)
        gqa = qi.shape[0] != ki.shape[0]
        if q_len == kv_len:  # no cached prefix: plain causal attention (torch's fused path)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(kv_len, device=q.device)[None, :]  # [q_len, kv_len]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
    return out


def _padded_prefill(q, k_cache, v_cache, req_to_token, rows, starts, q_lens, kv_lens, max_q_len, scale):
    """Many short chunks in one attention call: queries and keys padded to the longest chunk and
    context ([P, H, max_q_len, max_kv_len] scores), padding masked out."""
    dev = q.device
    max_kv_len = max(kv_lens)
    q_lens_t, kv_lens_t = torch.tensor(q_lens, device=dev), torch.tensor(kv_lens, device=dev)
    qi = torch.arange(max_q_len, device=dev)
    q_valid = qi[None, :] < q_lens_t[:, None]  # [P, Mq]
    token = torch.tensor(starts, device=dev)[:, None] + qi[None, :]  # packed index of each query
    qp = q[torch.where(q_valid, token, 0)].float().transpose(1, 2)  # [P, Hq, Mq, D]
    ki = torch.arange(max_kv_len, device=dev)
    kv_valid = ki[None, :] < kv_lens_t[:, None]  # [P, L]
    slots = torch.where(kv_valid, req_to_token[torch.tensor(rows, device=dev), :max_kv_len].long(), 0)
    kp = k_cache[slots].float().transpose(1, 2)  # [P, Hk, L, D]
    vp = v_cache[slots].float().transpose(1, 2)
    q_pos = (kv_lens_t - q_lens_t)[:, None] + qi[None, :]  # [P, Mq] position of each query
    mask = (ki[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]  # [P, Mq, L]
    mask |= ~q_valid[:, :, None]  # padded queries attend anywhere (their rows are dropped)
    o = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask[:, None], scale=scale, enable_gqa=qp.shape[1] != kp.shape[1]
    )
    out = torch.empty_like(q)
    out[token[q_valid]] = o.transpose(1, 2)[q_valid].to(q.dtype)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache, v_cache: [num_slots, Hk, D]; req_to_token: [rows, max_len] int32;
    req_rows, q_start, q_lens, kv_lens: [B] int32; max_q_len: max(q_lens) -> o: [T, Hq, D]."""
    if q.is_cuda:
        return prefill_attention_triton(
            q, k_cache, v_cache, req_to_token, req_rows, q_start, q_lens, kv_lens, max_q_len, scale
        )
    return prefill_attention_ref(
        q, k_cache, v_cache, req_to_token, req_rows, q_start, q_lens, kv_lens, max_q_len, scale
    )
