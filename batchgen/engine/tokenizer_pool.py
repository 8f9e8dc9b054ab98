"""Tokenizing ahead of the engine loop and detokenizing behind it, in worker threads.

Threads, not processes: a fast tokenizer encodes a batch in Rust with the GIL released, so a thread
takes most of the work off the loop (the chat template's Jinja, pure Python, stays one core's work); a
process pool starts slowly, makes the loop's thread unpickle every row's ids, and needs a tokenizer it
can reload.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class OrderedWorker:
    """Runs fn on batches of items, one batch at a time, in the order they were submitted; their
    results are taken back in that order, each item with its result. fn(batch) -> one result per
    item. threaded=False runs fn at once in submit, on the caller's thread (the in-loop path)."""

    def __init__(self, fn: Callable[[list], list], name: str, threaded: bool = True):
        self._fn = fn
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None
        self._batches: deque[tuple[list, Future | None]] = deque()  # None: held (submit's hold)
        self.pending = 0  # items submitted and not yet taken back
        self._held = 0  # batches submitted with hold and not started

    def submit(self, batch: list, hold: bool = False) -> None:
        """Queue a batch behind the ones before it and start it, or with hold leave it unstarted until
        release() (it counts in `pending` either way)."""
        if not batch:
            return
        self._batches.append((batch, None if hold else self._start(batch)))
        self.pending += len(batch)
        self._held += hold

    def release(self) -> None:
        """Start the held batches, in their order."""
        if not self._held:  # (the usual case: a call every step)
            return
        self._held = 0
        self._batches = deque((batch, self._start(batch) if future is None else future)
                              for batch, future in self._batches)

    def _start(self, batch: list) -> Future:
        if self._executor is not None:
            return self._executor.submit(self._fn, batch)
        future = Future()
        future.set_result(self._fn(batch))
        return future

    def take(self, wait_all: bool = False, oldest: bool = False) -> list[tuple]:
        """(item, result) of every batch done so far, oldest first, up to the first one running or held;
        wait_all: wait for every batch submitted; oldest: wait for the oldest batch and take it alone.
        A batch whose fn raised raises here."""
        out = []
        while self._batches and (wait_all or oldest or self._head_done()):
            batch, future = self._batches.popleft()
            self.pending -= len(batch)
            if future is None:  # held, and waited for: started now
                future = self._start(batch)
                self._held -= 1
            out.extend(zip(batch, future.result()))
            if oldest:
                break
        return out

    def _head_done(self) -> bool:
        future = self._batches[0][1]
        return future is not None and future.done()

    def close(self) -> None:
        """Drop what is queued and let the thread end after its current batch (a short one): the
        caller does not wait."""
        self._batches.clear()
        self.pending = self._held = 0
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
