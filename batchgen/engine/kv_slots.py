"""The KV pool's bookkeeping on the host: which token slots and token-table rows are free.

Allocation is per token: no block rounding, no fragmentation. With the prefix cache on, slots that the
cache holds for no running sequence count as available: `alloc` evicts them (least recently used
first) when the free list runs short. The tensors themselves are the executor's (executor/kv_cache.py).
"""
from __future__ import annotations

import weakref
from array import array


class KVSlots:
    def __init__(self, num_slots: int, max_num_seqs: int):
        self.num_slots = num_slots
        # int64s in an array rather than a list (a step allocates one slot per decoding sequence): the
        # garbage collector walks every list, and a pool holds millions of slots. Pops from the end.
        self.free_slots = array("q", range(num_slots - 1, -1, -1))
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._prefix_cache = None  # a weak reference to the PrefixCache over this pool (see prefix_cache)

    @property
    def prefix_cache(self):
        """The PrefixCache over this pool, when prefix caching is on, else None. Held weakly: the cache
        holds the pool (it frees evicted slots), and a cycle would keep the free lists alive after the
        engine is dropped, until the garbage collector happens to run."""
        return self._prefix_cache() if self._prefix_cache is not None else None

    @prefix_cache.setter
    def prefix_cache(self, cache) -> None:
        self._prefix_cache = weakref.ref(cache) if cache is not None else None

    def alloc(self, n: int) -> array:
        if n > len(self.free_slots) and (cache := self.prefix_cache) is not None:
            cache.evict(n - len(self.free_slots))
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
        cache = self.prefix_cache
        return len(self.free_slots) + (cache.evictable if cache is not None else 0)

    def alloc_row(self) -> int:
        return self.free_rows.pop()

    def free_row(self, row: int) -> None:
        self.free_rows.append(row)

    @property
    def num_used(self) -> int:
        """Slots running sequences hold (cached ones that none reads are not counted)."""
        return self.num_slots - self.num_available
