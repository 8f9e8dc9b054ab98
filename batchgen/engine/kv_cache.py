"""Token-granularity KV cache ("token attention").

One pool of `num_slots` token slots per layer, k and v each [num_layers, num_slots, kv_heads, head_dim]
on the device; a free list of slot indices (host side); a `req_to_token` table [max_num_seqs,
max_model_len] int32 on the device mapping (request row, position) -> slot. Allocation is per token:
no block rounding, no fragmentation. With the prefix cache on, slots that the cache holds for no
running sequence count as available: `alloc` evicts them (least recently used first) when the free
list runs short.
"""
from __future__ import annotations

from array import array

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
        # Host-side free list of int64s (a step allocates one slot per decoding sequence: a tensor
        # per slot would cost more than the bookkeeping itself), in an array rather than a list: the
        # garbage collector walks every list, and a pool holds millions of slots. Pops from the end.
        self.free_slots = array("q", range(num_slots - 1, -1, -1))
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.prefix_cache = None  # a PrefixCache over this pool, when prefix caching is on

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def alloc(self, n: int) -> array:
        if n > len(self.free_slots) and self.prefix_cache is not None:
            self.prefix_cache.evict(n - len(self.free_slots))
        assert 0 < n <= len(self.free_slots), f"asked for {n} slots, {self.num_free} free"
        slots = self.free_slots[-n:]
        del self.free_slots[-n:]
        return slots

    def free(self, slots: array) -> None:
        self.free_slots.extend(slots)

    @property
    def num_free(self) -> int:
        """Slots on the free list."""
        return len(self.free_slots)

    @property
    def num_available(self) -> int:
        """Slots an alloc can hand out: free ones and those the prefix cache would evict."""
        return len(self.free_slots) + (self.prefix_cache.evictable if self.prefix_cache is not None else 0)

    def alloc_row(self) -> int:
        return self.free_rows.pop()

    def free_row(self, row: int) -> None:
        self.free_rows.append(row)

    @property
    def num_used(self) -> int:
        """Slots running sequences hold (cached ones that none reads are not counted)."""
        return self.num_slots - self.num_available
