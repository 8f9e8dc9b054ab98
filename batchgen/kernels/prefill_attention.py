"""Prefill / extend attention over the packed ("nopad") batch.

Sequence i owns the packed query rows [q_start[i], q_start[i] + q_lens[i]). Its keys and values are
its first kv_lens[i] tokens, cached ones included, read through the token table:
    slot(i, p) = req_to_token[req_rows[i], p],   p < kv_lens[i]
The new tokens sit at the last q_lens[i] positions, so query j (0-based within the chunk) is at
position kv_lens[i] - q_lens[i] + j and attends causally to positions <= its own. Splitfuse chunks
of a long prompt are just sequences whose kv_lens exceed their q_lens. GQA: query head h reads KV
head h // (Hq / Hk).

    o = softmax(q k^T * scale + causal_mask) v
"""
import torch
import torch.nn.functional as F


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
    out = torch.empty_like(q)
    for row, start, q_len, kv_len in zip(
        req_rows.tolist(), q_start.tolist(), q_lens.tolist(), kv_lens.tolist()
    ):
        slots = req_to_token[row, :kv_len].long()
        qi = q[start : start + q_len].float().transpose(0, 1)  # [Hq, q_len, D]
        ki = k_cache[slots].float().transpose(0, 1)  # [Hk, kv_len, D]
        vi = v_cache[slots].float().transpose(0, 1)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = q_pos[:, None] >= torch.arange(kv_len, device=q.device)[None, :]  # [q_len, kv_len]
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=qi.shape[0] != ki.shape[0]
        )
        out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
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
    return prefill_attention_ref(
        q, k_cache, v_cache, req_to_token, req_rows, q_start, q_lens, kv_lens, max_q_len, scale
    )
