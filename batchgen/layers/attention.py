"""Attention over the token-slot KV pool: rope on q and k and the store of the new K/V (one fused op),
then attention reading K/V through req_to_token: one unified launch for decodes and chunks together
when the batch says so (step graphs), otherwise decode attention for the decode sequences and
prefill (extend) attention for the chunks. A lone decode sequence on a GPU takes all of it in one
launch instead (kernels/rope_decode_attention.py). With batch_invariant (EngineConfig) every step on a
GPU takes the unified launch's one tile, so a query's bits do not depend on its step. The layer picks
the path from the batch and the tensors; the model only hands it q, k and v before rope."""
from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.rope_decode_attention import rope_decode_attention
from batchgen.kernels.rope_store_kv import rope_store_kv
from batchgen.kernels.unified_attention import unified_attention
from batchgen.layers.forward_batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # [num_slots, num_kv_heads, head_dim] each; the runner assigns this layer's slice of the pool
        self.k_cache = self.v_cache = torch.empty(0)
        # per-tensor scales of an fp8 KV cache: the checkpoint's (kv_cache_scheme, models/loader.py), else 1.0
        self.k_scale = self.v_scale = 1.0
        # GPU: every step's queries through unified attention's one tile (EngineConfig.batch_invariant)
        self.batch_invariant = False

    def _takes_one_launch(self, q: torch.Tensor, batch: ForwardBatch) -> bool:
        """A decode step of one sequence on a GPU: rope, the KV store and attention in one launch. Not
        for fp32 (its dots would not be exact), an fp8 pool, or head_dim other than 32 or 64 (larger
        heads would hold more of the merge in registers)."""
        return (q.is_cuda and not self.batch_invariant and q.shape[0] == 1 and batch.num_decode == 1
                and batch.num_prefill == 0 and not batch.unified and q.dtype in (torch.float16, torch.bfloat16)
                and self.k_cache.dtype == q.dtype and self.head_dim in (32, 64))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] before rope; positions [T]; cos_sin_cache [P, D] fp32 = [cos | sin]
        -> [T, Hq, D]. Afterwards q and k hold unspecified values: the one launch leaves them as they
        were, rope_store_kv rotates q in place (and, on the CPU, k)."""
        scale, v_scale = self.scale, None
        if self.k_cache.dtype == torch.float8_e4m3fn and (self.k_scale != 1.0 or self.v_scale != 1.0):
            # the pool holds k / k_scale and v / v_scale (rope is linear): q.k = k_scale * (q.k_pool),
            # and the output is v_scale * (p.v_pool)
            k, v, scale, v_scale = k / self.k_scale, v / self.v_scale, scale * self.k_scale, self.v_scale
        out = self._attend(q, k, v, positions, cos_sin_cache, batch, scale)
        return out if v_scale is None else out * v_scale

    def _attend(self, q, k, v, positions, cos_sin_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """forward's attention with softmax scale `scale`, by the path the batch and the tensors pick."""
        if self._takes_one_launch(q, batch):
            return rope_decode_attention(
                q, k, v, self.k_cache, self.v_cache, batch.req_to_token, batch.decode_rows, batch.decode_kv_lens,
                positions, batch.out_slots, cos_sin_cache, batch.decode_max_kv_len, scale,
            )
        rope_store_kv(q, k, v, positions, cos_sin_cache, self.k_cache, self.v_cache, batch.out_slots)
        invariant = self.batch_invariant and q.is_cuda  # (decode steps too: every batch has a unified view)
        if batch.unified or invariant:
            return unified_attention(
                q, self.k_cache, self.v_cache, batch.req_to_token, batch.seq_rows, batch.q_start,
                batch.kv_lens, scale, invariant,
            )
        nd = batch.num_decode
        if batch.num_prefill == 0:
            return decode_attention(
                q, self.k_cache, self.v_cache, batch.req_to_token, batch.decode_rows,
                batch.decode_kv_lens, batch.decode_max_kv_len, scale, batch.decode_schedule,
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(
                q[:nd], self.k_cache, self.v_cache, batch.req_to_token, batch.decode_rows,
                batch.decode_kv_lens, batch.decode_max_kv_len, scale, batch.decode_schedule,
            )
        out[nd:] = prefill_attention(
            q[nd:], self.k_cache, self.v_cache, batch.req_to_token, batch.prefill_rows,
            batch.prefill_q_start, batch.prefill_q_lens, batch.prefill_kv_lens, batch.prefill_max_q_len, scale,
        )
        return out
