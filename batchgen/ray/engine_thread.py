"""The engine of an actor on one thread for the actor's life, fed by a queue of requests from any
number of batches at once: the next batch's rows join the running batch while the current one ends."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from batchgen.io.rows import ROW_KEY
from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams, samples_of

log = logging.getLogger("batchgen")


@dataclass
class _Batch:
    """One __call__'s requests in the engine: its results so far, and the future that gets them."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    expected: dict[int, int]  # row key -> results the request gets (n samples)
    results: dict[int, list[dict]] = field(default_factory=dict)
    left: int = 0  # requests not finished

    def add(self, key: int, row: dict) -> bool:
        """Take a result; True when the request is finished (all its samples, or an error row)."""
        rows = self.results.setdefault(key, [])
        rows.append(row)
        return row.get("finish_reason") == "error" or len(rows) == self.expected[key]


class EngineThread:
    """`llm.generate` on one thread for the actor's life, fed by a queue of requests from any number
    of batches at once; each batch's results are handed back to its event loop when all are in."""

    IDLE_WAIT_S = 1.0  # how often an idle engine thread checks whether it was closed

    def __init__(self, llm: LLM, sampling: SamplingParams):
        self.llm = llm
        self.sampling = sampling
        self._queue: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._owner: dict[int, _Batch] = {}  # row key -> its batch, while the request is not finished
        self._in_engine = 0  # requests the engine took and did not finish
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first batch

    async def generate(self, requests: list[dict]) -> dict[int, list[dict]]:
        """The results of `requests` (checked rows, each with a unique ROW_KEY), by row key."""
        loop = asyncio.get_running_loop()
        default_n = self.sampling.n
        batch = _Batch(loop, loop.create_future(), {r[ROW_KEY]: samples_of(r, default_n) for r in requests})
        batch.left = len(requests)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="batchgen-ray-engine", daemon=True)
                self._thread.start()
            for request in requests:
                self._owner[request[ROW_KEY]] = batch
                self._queue.put(request)
        return await batch.future

    def close(self) -> None:
        self._closed.set()

    def _requests(self):
        """The engine's source: queued requests; None ("nothing right now") while it has work and the
        queue is empty; a blocking wait while it has none. Ends when closed."""
        while not self._closed.is_set():
            try:
                request = self._queue.get(block=self._in_engine == 0, timeout=self.IDLE_WAIT_S)
            except queue.Empty:
                if self._in_engine:
                    yield None
                continue
            with self._lock:
                self._in_engine += 1
            yield request

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                for result in self.llm.generate(self._requests(), self.sampling):
                    self._finish(result)
            except Exception as e:  # a broken device, not a bad row: fail the batches it held
                log.exception("the engine failed (%s); its batches fail", type(e).__name__)
                self._fail_all(e)

    def _finish(self, result: dict) -> None:
        key = result.pop(ROW_KEY, None)
        with self._lock:
            batch = self._owner.get(key)
            if batch is None:  # a later sample of a request that ended with an error row
                log.debug("result for a finished request (id %r) dropped", result.get("id"))
                return
            if not batch.add(key, result):
                return
            del self._owner[key]
            self._in_engine -= 1
            batch.left -= 1
            if batch.left == 0:
                batch.loop.call_soon_threadsafe(_settle, batch.future, batch.results)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            while True:  # requests not yet taken belong to the batches failed here
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            for batch in {id(b): b for b in self._owner.values()}.values():
                batch.loop.call_soon_threadsafe(_fail, batch.future, error)
            self._owner.clear()
            self._in_engine = 0


def _settle(future: asyncio.Future, results: dict) -> None:
    if not future.done():
        future.set_result(results)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


