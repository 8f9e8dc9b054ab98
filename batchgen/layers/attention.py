"""Attention over the token-slot KV pool: store the new K/V, then either one unified launch for every
sequence of the step (a step graph's batch: decodes and prefill chunks alike) or decode attention
for the decode sequences and prefill (extend) attention for the chunks, each reading K/V through
req_to_token."""
from __future__ import annotations

import torch
from torch import nn

from batchgen.forward.batch import ForwardBatch
from batchgen.kernels import decode_attention, prefill_attention, store_kv, unified_attention


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # [num_slots, num_kv_heads, head_dim] each; the runner assigns this layer's slice of the pool
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D]"""
        store_kv(k, v, self.k_cache, self.v_cache, batch.out_slots)
        if batch.unified:
            return unified_attention(
                q, self.k_cache, self.v_cache, batch.req_to_token, batch.seq_rows, batch.q_start, batch.kv_lens,
                self.scale,
            )
        nd = batch.num_decode
        if batch.num_prefill == 0:
            return decode_attention(
                q, self.k_cache, self.v_cache, batch.req_to_token, batch.decode_rows,
                batch.decode_kv_lens, batch.decode_max_kv_len, self.scale,
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(
                q[:nd], self.k_cache, self.v_cache, batch.req_to_token, batch.decode_rows,
                batch.decode_kv_lens, batch.decode_max_kv_len, self.scale,
            )
        out[nd:] = prefill_attention(
            q[nd:], self.k_cache, self.v_cache, batch.req_to_token, batch.prefill_rows,
            batch.prefill_q_start, batch.prefill_q_lens, batch.prefill_kv_lens, batch.prefill_max_q_len, self.scale,
        )
        return out
