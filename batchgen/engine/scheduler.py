"""The router: each step builds one batch under a token budget and a sequence cap.

Every running sequence that has finished its prompt contributes its decode token; the rest of the
budget goes to prefill chunks, first of running sequences part-way through their prompt, then of
waiting ones (splitfuse: a long prompt is prefilled over several steps while decodes keep going).
A waiting sequence is admitted when the expected KV use of everything running, plus its own, fits
in the free slots. When the pool runs dry anyway, the newest running sequences are preempted: their
KV is freed and they are recomputed later (their tokens so far become their prompt).
"""
from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass

from batchgen.engine.kv_cache import KVCache
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

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


def expected_future_tokens(seq: Sequence) -> int:
    fraction = 1.0 if seq.params.ignore_eos else EXPECTED_OUTPUT_FRACTION
    return seq.num_uncomputed + math.ceil(fraction * (seq.params.max_tokens - seq.num_generated))


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: newest last

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
        kv = self.kv
        batch = ScheduledBatch([], [], [], [], 0)
        budget = self.max_num_batched_tokens

        def take(seq: Sequence, n: int) -> None:
            batch.seqs.append(seq)
            batch.starts.append(seq.num_computed)
            batch.num_new.append(n)
            slots = kv.alloc(n)
            batch.slots += slots
            seq.slots += slots
            seq.num_computed += n

        for seq in list(self.running):  # decodes, oldest first
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1 or seq.done_sampling:
                continue
            while kv.num_free == 0 and seq.status is Status.RUNNING:
                self.preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                take(seq, 1)
        batch.num_decode = len(batch.seqs)
        budget -= batch.num_decode

        for seq in self.running:  # prompts part-way through, oldest first
            if seq.num_uncomputed > 0 and not seq.done_sampling:  # (this step's decodes have none left)
                n = min(seq.num_uncomputed, budget, kv.num_free)
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
                reserved = sum(expected_future_tokens(s) for s in self.running)
            need = expected_future_tokens(seq)
            if self.running and reserved + need > kv.num_free:
                break
            n = min(seq.num_uncomputed, budget, kv.num_free)
            if n <= 0:
                break
            self.waiting.popleft()
            seq.row = kv.alloc_row()
            seq.status = Status.RUNNING
            self.running.append(seq)
            take(seq, n)
            budget -= n
            reserved += need - n
        return batch

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
        if seq.slots:
            self.kv.free(seq.slots)
            seq.slots = array("q")
        if seq.row >= 0:
            self.kv.free_row(seq.row)
            seq.row = -1
        self.running.remove(seq)
