"""Decode attention: one new query token per sequence against its whole cached context, read
through the token table (slot(i, p) = req_to_token[req_rows[i], p], p < kv_lens[i]; the new
token's own K/V is already stored). GQA: query head h reads KV head h // (Hq / Hk).

    o_i = softmax(q_i K_i^T * scale) V_i
"""
import torch


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
    k = k_cache[slots].float()  # [B, L, Hk, D]
    v = v_cache[slots].float()
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hk, D]; req_to_token: [rows, max_len] int32;
    req_rows, kv_lens: [B] int32; max_kv_len: an upper bound of kv_lens -> o: [B, Hq, D]."""
    return decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, kv_lens, max_kv_len, scale)
