"""`batchgen worker`: a consumer of the request stream that keeps one engine fed.

The engine pulls requests from `_feed()` whenever it has room; the feed hands it messages read with
XREADGROUP (new ones) and XAUTOCLAIM (ones whose worker went silent), and answers None ("nothing
right now") when the stream is empty, so that requests flow into the running batch as capacity frees.
Each result goes back in one server-side step (protocol.FINISH): result added to the job's result
stream, message acknowledged and deleted, only if the message is still pending. Hence:

- at-least-once delivery: a message leaves the group only with its result (or its dead letter);
- one result per message: a slow worker whose message was reclaimed and answered elsewhere finds it
  no longer pending, and its late result is dropped;
- a crash loses nothing: a dead worker's messages stay pending, idle, and another worker's
  XAUTOCLAIM takes them after `claim_idle_s`. Live workers refresh their messages' idle time
  (protocol.TOUCH) so that requests waiting in a busy engine are not taken from them;
- a message delivered more than `max_deliveries` times (its workers died, or the engine raised on it)
  goes to the dead-letter stream with an error result. Its last try runs alone in the engine, so a
  request that merely shared a batch with a poisonous one is not condemned with it;
- Redis unreachable: every call backs off and retries; finished results wait in memory and are
  written when Redis is back; the engine keeps working on what it has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from batchgen.queue.metrics import WorkerMetrics
from batchgen.queue.protocol import (
    DELETE_IDLE_CONSUMER,
    FATAL,
    FINISH,
    GROUP,
    TOUCH,
    Backoff,
    Keys,
    Message,
    ensure_group,
    to_json,
)
from batchgen.queue.worker_feed import MessageIntake
from batchgen.queue.worker_redis import RedisCalls, RedisUnavailable
from batchgen.queue.worker_results import Answer, ResultWriting

log = logging.getLogger("batchgen.worker")


@dataclass
class WorkerConfig:
    consumer: str
    claim_idle_s: float = 60.0
    max_deliveries: int = 3
    drain_timeout_s: float = 30.0
    max_in_flight: int = 64  # messages taken from the stream and not yet answered, at most
    block_ms: int = 250  # XREADGROUP's wait when the engine has nothing to do
    busy_poll_s: float = 0.05  # while the engine is busy, look for new messages at most this often
    stats_every_s: float = 30.0

    def __post_init__(self) -> None:
        if self.claim_idle_s <= 0:
            raise ValueError("invalid --claim-idle-seconds: must be > 0")
        if self.max_deliveries < 1:
            raise ValueError("invalid --max-deliveries: must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError("invalid --drain-timeout: must be >= 0")
        if not self.consumer or any(c.isspace() for c in self.consumer):
            raise ValueError(f"invalid --consumer {self.consumer!r}: a name without spaces")


class Worker(MessageIntake, ResultWriting, RedisCalls):
    """One engine fed from the request stream. Its parts: worker_feed.py (messages in), worker_results.py
    (answers out), worker_redis.py (Redis calls with backoff); here its state, its loop and its stop."""

    def __init__(self, client: redis.Redis, keys: Keys, llm: Any, sampling: Any, config: WorkerConfig,
                 metrics: WorkerMetrics | None = None, description: dict | None = None) -> None:
        self.client = client
        self.keys = keys
        self.llm = llm
        self.sampling = sampling
        self.config = config
        self.metrics = metrics or WorkerMetrics(llm)
        self.description = to_json(description or {})
        self._finish = client.register_script(FINISH)
        self._touch = client.register_script(TOUCH)
        self._delete_consumer = client.register_script(DELETE_IDLE_CONSUMER)

        self.buffer: deque[Message] = deque()  # taken from the stream, not yet handed to the engine
        self.last_chance: deque[Message] = deque()  # ditto, on their last delivery: they run alone
        self.in_flight: dict[str, Message] = {}  # handed to the engine, not every result yet
        # in-flight messages with results: (results the message gets, its results so far)
        self.samples_done: dict[str, tuple[int, list[dict]]] = {}
        self.unsent: deque[Answer] = deque()  # answered, not yet written (Redis was away)
        self._alone: str | None = None  # the message running alone in the engine
        self._owned: set[str] = set()  # ids of all of the above: pending for this worker
        self._owned_lock = threading.Lock()  # the heartbeat thread reads `_owned`
        self._beat_stop = threading.Event()
        self._registered: set[str] = set()  # jobs whose workers hash names this worker

        self.draining = threading.Event()  # no more reading; finish what the engine has
        self.stop_event = threading.Event()  # the engine drops what it has at its next step
        self._drain_deadline: float | None = None
        self.backoff = Backoff()
        self._down_since: float | None = None
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._next_poll = 0.0
        self._next_stats = time.monotonic() + config.stats_every_s
        self.counts = dict(results=0, errors=0, dead_letters=0, malformed=0, superseded=0, reclaimed=0,
                           released=0, engine_failures=0, redis_errors=0)

    # --- control ------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Stop reading and finish what the engine has, for at most drain_timeout_s; called again, stop
        at once. Safe to call from a signal handler."""
        if self.draining.is_set():
            self.stop_event.set()
            return
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        self.draining.set()
        timer = threading.Timer(self.config.drain_timeout_s, self.stop_event.set)
        timer.daemon = True
        timer.start()

    def run(self) -> dict:
        """Serves until drained or stopped -> counts of what it did. Raises only for what waiting cannot
        fix: a refused login, or an engine that fails again and again without finishing anything."""
        self._start()
        beat = threading.Thread(target=self._heartbeat, name="batchgen-heartbeat", daemon=True)
        beat.start()
        failures_in_a_row = 0
        try:
            while not (self.draining.is_set() or self.stop_event.is_set()):
                try:
                    for result in self.llm.generate(self._feed(), sampling=self.sampling, stop_event=self.stop_event):
                        failures_in_a_row = 0
                        self._on_result(result)
                except FATAL:
                    raise
                except Exception as e:  # the engine raised: a request it could not take, or a broken device
                    failures_in_a_row += 1
                    self.counts["engine_failures"] += 1
                    self.metrics.engine_failures.inc()
                    log.error("engine failed (%s: %s); its %d requests go back to the stream, each try counted",
                              type(e).__name__, e, len(self.in_flight), exc_info=True,
                              extra={"event": "engine_failure", "requests": len(self.in_flight)})
                    self._give_back(list(self.in_flight), tried=True)
                    self.in_flight.clear()
                    self.samples_done.clear()
                    self.metrics.in_flight.set(0)
                    self._alone = None
                    if failures_in_a_row >= 2 * self.config.max_deliveries:
                        raise RuntimeError(f"the engine failed {failures_in_a_row} times in a row without finishing "
                                           f"a request; last error: {type(e).__name__}: {e}") from e
        finally:
            self._shutdown()
            self._beat_stop.set()
            beat.join()
        return dict(self.counts)

    # --- start and stop -----------------------------------------------------------------------------

    def _start(self) -> None:
        while not (self.draining.is_set() or self.stop_event.is_set()):
            try:
                self._call(ensure_group, self.client, self.keys)
                return
            except RedisUnavailable:
                self.backoff.wait()

    def _shutdown(self) -> None:
        """Write what is finished (until the drain deadline while Redis is away), then hand back the rest."""
        deadline = self._drain_deadline or time.monotonic()
        self.backoff.succeeded()  # one try now, whatever the backoff said
        self._send_unsent()
        while self.unsent and time.monotonic() < deadline:
            self.backoff.wait()
            self._send_unsent()
        with self._owned_lock:
            left = list(self._owned)
        self._give_back(left, tried=False)
        log.info("worker %s stopped: %s; %d requests left for other workers", self.config.consumer,
                 ", ".join(f"{v} {k}" for k, v in self.counts.items() if v) or "nothing done", len(left),
                 extra={"event": "stopped", **self.counts, "left": len(left)})
        if not left:  # a tidy group: no consumer entry for a worker that is gone and owns nothing
            try:
                self._delete_consumer(keys=[self.keys.requests], args=[GROUP, self.config.consumer])
            except redis.RedisError:
                pass

