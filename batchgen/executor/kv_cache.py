"""Token-granularity KV cache ("token attention"), its tensors on the device.

One pool of `num_slots` token slots per layer, k and v each [num_layers, num_slots + 1, kv_heads,
head_dim], and a `req_to_token` table [max_num_seqs + 1, max_model_len] int32 mapping (request row,
position) -> slot. Which slots and rows are free is the host's business (engine/kv_slots.py).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_num_seqs: int,
        max_model_len: int, dtype: torch.dtype, device: torch.device,
    ):
        self.num_slots = num_slots
        # One more slot and one more row than are ever handed out: padding entries of a CUDA-graph
        # batch write their K/V there and attend to it, harming no real request.
        self.pad_slot, self.pad_row = num_slots, max_num_seqs
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.req_to_token = torch.zeros((max_num_seqs + 1, max_model_len), dtype=torch.int32, device=device)
        self.req_to_token[self.pad_row, 0] = self.pad_slot

    def release(self) -> None:
        """Free the pool's device memory; it holds no slots afterwards."""
        self.k = self.v = torch.empty(0, dtype=self.k.dtype, device=self.k.device)
        self.req_to_token = torch.empty((0, 0), dtype=torch.int32, device=self.k.device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
