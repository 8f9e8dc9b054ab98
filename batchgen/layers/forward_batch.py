"""The tensors of one model step: a packed ("nopad") token array and per-sequence index tensors.

Sequences are ordered decodes first: the first `num_decode` sequences contribute one token each
(tokens [0, num_decode)), the remaining `prefill` sequences contribute chunks of their prompts
(tokens [num_decode, T)). All tensors live on the model's device.

A "unified" step (a mixed step graph, docs/STEP.md) describes decodes and chunks alike for one
attention launch (kernels/unified_attention.py): sequence i owns tokens [q_start[i], q_start[i + 1]),
padding sequences own none, and tokens past q_start[B_pad] are padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    out_slots: torch.Tensor  # [T] int64, KV pool slot where each token's K/V is stored
    token_rows: torch.Tensor  # [T] int32, req_to_token row of each token's sequence
    req_to_token: torch.Tensor  # [max_num_seqs, max_model_len] int32, (row, position) -> slot
    num_decode: int
    decode_rows: torch.Tensor  # [D] int32, req_to_token row of each decode sequence
    decode_kv_lens: torch.Tensor  # [D] int32, context length including the new token
    decode_max_kv_len: int
    prefill_rows: torch.Tensor  # [P] int32
    prefill_q_start: torch.Tensor  # [P] int32, first token of the chunk, relative to num_decode
    prefill_q_lens: torch.Tensor  # [P] int32, chunk length
    prefill_kv_lens: torch.Tensor  # [P] int32, cached tokens + chunk
    prefill_max_q_len: int
    logits_indices: torch.Tensor  # [S] int64, tokens whose next-token logits are sampled (decodes' first)
    # Every sequence at once (decodes first), for attention in one launch (a step graph's
    # kernels/unified_attention.py): sequence i's queries are tokens [q_start[i], q_start[i + 1]).
    unified: bool = False  # attend through seq_rows / q_start / kv_lens instead of the split paths
    seq_rows: torch.Tensor | None = None  # [B] int32, req_to_token row of each sequence
    q_start: torch.Tensor | None = None  # [B + 1] int32, cumulative query counts
    kv_lens: torch.Tensor | None = None  # [B] int32, context length including the new tokens
    # [3, D] int32, the decode sequences longest context first with their kv_lens and rows
    # (kernels/longest_first.py), made once a step for every layer (by a decode graph, or the runner before
    # an eager step); None: each layer makes its own
    decode_schedule: torch.Tensor | None = None

    @property
    def num_prefill(self) -> int:
        return self.prefill_rows.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def samples_every_token(self) -> bool:
        """A decode-only step: every token is sampled, in order (logits_indices is [0, T))."""
        return self.num_decode == self.input_ids.shape[0]

    def record_slots(self) -> None:
        """Write the new tokens' slots into the token table: req_to_token[row, position] = slot.
        Never inside a CUDA graph: the number of writes changes from step to step."""
        self.req_to_token[self.token_rows.long(), self.positions] = self.out_slots.to(torch.int32)
