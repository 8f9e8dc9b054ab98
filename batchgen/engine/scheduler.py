"""The router: each step builds one batch under a token budget and a sequence cap.

Every running sequence that has finished its prompt contributes its decode token; the rest of the
budget goes to prefill chunks, first of running sequences part-way through their prompt, then of
waiting ones (splitfuse: a long prompt is prefilled over several steps while decodes keep going).
A waiting sequence is admitted when the expected KV use of everything running, plus its own, fits
in the free slots. When the pool runs dry anyway, the newest running sequences are preempted: their
KV is freed and they are recomputed later (their tokens so far become their prompt).

With the prefix cache, a sequence first takes the longest cached prefix of its prompt (its token
table row points at the shared slots: `prefix_*` writes of the batch) and computes only the rest;
budget and admission count only what it computes. The prompt tokens it computes go into the cache
as soon as they are scheduled, so a sequence admitted after it (in the same step or later) reuses
them: inside one step, every layer stores the K/V of all the step's tokens before attention reads
any. A sequence holds its cached prefix locked; releasing it (finish, preemption) frees only its
own slots.
"""
from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.kv_slots import KVSlots
from batchgen.engine.prefix_cache import PrefixCache
from batchgen.engine.request import Sequence, Status

# Expected fraction of max_tokens a request still generates, for admission. Requests that ignore
# EOS generate exactly max_tokens; others usually stop early, and preemption covers the misses.
EXPECTED_OUTPUT_FRACTION = 0.5


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes first, then prefill chunks
    starts: list[int]  # first position computed this step, per sequence
    num_new: list[int]  # tokens computed this step, per sequence
    slots: list[int]  # KV slots of those tokens, all sequences' in order
    num_decode: int
    # token-table writes of cached prefixes: req_to_token[prefix_rows[i], prefix_positions[i]] = prefix_slots[i]
    prefix_rows: array = field(default_factory=lambda: array("q"))
    prefix_positions: array = field(default_factory=lambda: array("q"))
    prefix_slots: array = field(default_factory=lambda: array("q"))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


def expected_future_tokens(seq: Sequence) -> int:
    """Its uncomputed tokens + the expected share of its tokens still to generate (the sequence's
    properties inlined: summed over every running sequence at each admission)."""
    num_tokens = len(seq.token_ids) + seq.num_pending
    left = seq.params.max_tokens - (num_tokens - seq.num_prompt)
    expected = left if seq.params.ignore_eos else math.ceil(EXPECTED_OUTPUT_FRACTION * left)
    return num_tokens - seq.num_computed + expected


class Scheduler:
    def __init__(self, kv: KVSlots, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool = False):
        self.kv = kv
        self.cache = PrefixCache(kv) if prefix_caching else None
        kv.prefix_cache = self.cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: newest last
        self._arange = array("q")

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        while True:
            batch = self._try_schedule()
            if batch.seqs:
                return batch
            if not any(not s.done_sampling for s in self.running):
                return None  # nothing runnable (running ones only await their last token's read-back)
            # Every runnable sequence is stuck part-way through a prompt with no free slot.
            self.preempt(self.running[-1])

    def _try_schedule(self) -> ScheduledBatch:
        kv, cache = self.kv, self.cache
        batch = ScheduledBatch([], [], [], [], 0)
        budget = self.max_num_batched_tokens

        def take(seq: Sequence, n: int) -> None:
            start = seq.num_computed
            if seq.num_in_table < start:  # cached slots attached since its last step: into its row
                self._prefix_writes(batch, seq, start)
            seq.num_in_table = start + n  # the step writes its new tokens' slots itself
            batch.seqs.append(seq)
            batch.starts.append(start)
            batch.num_new.append(n)
            slots = kv.alloc(n)
            batch.slots += slots
            seq.slots += slots
            seq.num_computed += n
            if cache is not None and seq.num_cached == start < seq.num_prompt:
                self._cache_prompt(seq, start, min(start + n, seq.num_prompt), slots)

        # One pass over the running sequences (every step, all of them: properties inlined) ->
        # decodes (one token left to compute) and prompts part-way through, oldest first; those
        # whose last token is sampled already have nothing to schedule.
        decodes, partial = [], []
        for seq in self.running:
            num_tokens = len(seq.token_ids) + seq.num_pending
            if num_tokens - seq.num_prompt >= seq.params.max_tokens:
                continue
            left = num_tokens - seq.num_computed
            if left == 1:
                decodes.append(seq)
            elif left > 1:
                partial.append(seq)
        # The pool runs dry: preempt the newest until the decodes left fit (decodes are in running
        # order, so a decode preempted is the last one). alloc evicts the cached slots it needs.
        while len(decodes) > kv.num_available:
            victim = self.running[-1]
            self.preempt(victim)
            if decodes and decodes[-1] is victim:
                decodes.pop()
        self._take_decodes(batch, decodes)
        batch.num_decode = len(batch.seqs)
        budget -= batch.num_decode

        for seq in partial:
            if seq.status is not Status.RUNNING:  # preempted above for a decode's slot
                continue
            self._reuse(seq)  # what others computed since (a prompt they share)
            n = min(seq.num_uncomputed, budget, kv.num_available)
            if n <= 0:
                break
            take(seq, n)
            budget -= n

        reserved = None  # the running ones' expected KV use, summed only once a request may be admitted
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token still in flight: wait for its read-back
                break
            if reserved is None:
                reserved = sum(map(expected_future_tokens, self.running))
            node, cached = self._lookup(seq)  # locked: the check below counts only the rest
            need = expected_future_tokens(seq) - len(cached)
            n = min(seq.num_uncomputed - len(cached), budget, kv.num_available)
            if (self.running and reserved + need > kv.num_available) or n <= 0:
                if node is not None:
                    self.cache.unlock(node)
                break
            self.waiting.popleft()
            seq.row = kv.alloc_row()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if node is not None:
                self._attach(seq, node, cached)
            take(seq, n)
            budget -= n
            reserved += need - n
        return batch

    def _take_decodes(self, batch: ScheduledBatch, decodes: list[Sequence]) -> None:
        """take(seq, 1) for each of the decodes, with their slots allocated at once (they fit)."""
        if not decodes:
            return
        cache = self.cache
        slots = self.kv.alloc(len(decodes))
        starts = batch.starts
        for seq, slot in zip(decodes, slots):
            start = seq.num_computed
            if seq.num_in_table < start:
                self._prefix_writes(batch, seq, start)
            seq.num_in_table = seq.num_computed = start + 1
            seq.slots.append(slot)
            starts.append(start)
            if cache is not None and seq.num_cached == start < seq.num_prompt:  # a prompt's last token
                self._cache_prompt(seq, start, start + 1, seq.slots[start:])
        batch.seqs += decodes
        batch.num_new += [1] * len(decodes)
        batch.slots += slots

    def _prefix_writes(self, batch: ScheduledBatch, seq: Sequence, start: int) -> None:
        """The token-table writes of cached slots attached to the sequence since its last step."""
        batch.prefix_rows.extend(array("q", [seq.row]) * (start - seq.num_in_table))
        batch.prefix_positions.extend(self._positions(seq.num_in_table, start))
        batch.prefix_slots.extend(seq.slots[seq.num_in_table : start])

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self._release(seq)
        elif seq.status is Status.WAITING:  # preempted while its last token was in flight
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        """Give back what the sequence holds: its own slots; its lock on the cached prefix."""
        if len(seq.slots) > seq.num_cached:
            self.kv.free(seq.slots[seq.num_cached :])
        seq.slots = array("q")
        seq.num_in_table = 0
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
            seq.cache_node, seq.num_cached = None, 0
        if seq.row >= 0:
            self.kv.free_row(seq.row)
            seq.row = -1
        self.running.remove(seq)

    # ---- prefix cache --------------------------------------------------------------------------
    def _positions(self, start: int, end: int) -> array:
        """array('q', range(start, end)), sliced from one kept array (C speed, no int per element)."""
        if len(self._arange) < end:
            self._arange = array("q", range(max(end, 2 * len(self._arange))))
        return self._arange[start:end]

    def _lookup(self, seq: Sequence) -> tuple:
        """The longest cached prefix a waiting sequence may reuse, locked -> (node, its slots), or
        (None, empty) when there is none."""
        if self.cache is None or seq.reuse_limit <= 0 or seq.token_ids[0] not in self.cache.root.children:
            return None, array("q")
        node, slots = self.cache.match(self.cache.root, seq.token_ids[: seq.reuse_limit])
        if not slots:
            return None, slots
        self.cache.lock(node)
        return node, slots

    def _attach(self, seq: Sequence, node, slots: array) -> None:
        """Extend the sequence's computed prefix with cached slots (node: locked for it, the end of
        the path they are on); its token table row gets them with its next step's prefix writes."""
        n = len(slots)
        seq.slots += slots
        seq.num_computed += n
        seq.num_cached += n
        if seq.num_preemptions == 0:  # a recomputation reuses its own prompt: not counted
            seq.cached_prompt_tokens += n
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.cache_node = node

    def _reuse(self, seq: Sequence) -> None:
        """A running sequence part-way through its prompt, all of it so far from or in the cache:
        take what the cache has gained beyond it since."""
        if self.cache is None or seq.num_cached != seq.num_computed or seq.num_computed >= seq.reuse_limit:
            return
        parent = seq.cache_node or self.cache.root
        if seq.token_ids[seq.num_computed] not in parent.children:
            return
        node, slots = self.cache.match(parent, seq.token_ids[seq.num_computed : seq.reuse_limit])
        self.cache.lock(node)
        self._attach(seq, node, slots)

    def _cache_prompt(self, seq: Sequence, start: int, end: int, slots: array) -> None:
        """Prompt tokens [start, end) just scheduled, right after the sequence's cached prefix: into
        the cache (which takes their slots), unless it has them already (a whole-prompt match left
        the last token to compute: that one stays the sequence's own)."""
        parent = seq.cache_node or self.cache.root
        if seq.token_ids[start] in parent.children:
            return
        leaf = self.cache.insert(parent, seq.token_ids[start:end], slots[: end - start])
        self.cache.lock(leaf)
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.cache_node, seq.num_cached = leaf, end
