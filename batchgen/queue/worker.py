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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from batchgen.io.rows import RowError, check_columns_text
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
    decode_request,
    encode_dead_letter,
    encode_result,
    ensure_group,
    request_id_of,
    text,
    to_json,
)
from batchgen.sampling_params import samples_of
from batchgen.schema import KNOWN_FIELDS, error_result
from batchgen.unicode_text import writable

log = logging.getLogger("batchgen.worker")

MSG_KEY = "__batchgen_msg__"  # carried through the engine: which message a result answers


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


@dataclass
class _Answer:
    message: Message
    entries: list[list[str]]  # the result stream entries (one per sample); none for a message without a job
    dead: list[str] | None  # the dead-letter stream entry, if it goes there
    error: bool  # an error result


class _Unavailable(Exception):
    """Redis did not answer; the call is retried later (the backoff says when)."""


class Worker:
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
        self.unsent: deque[_Answer] = deque()  # answered, not yet written (Redis was away)
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

    # --- the feed -----------------------------------------------------------------------------------

    def _feed(self) -> Iterator[dict | None]:
        while not (self.draining.is_set() or self.stop_event.is_set()):
            self._service()
            request = self._next_request()
            if request is not None:
                yield request
                continue
            if not self.in_flight:  # the engine is idle and will ask again at once: don't spin
                self._idle_wait()
            yield None

    def _next_request(self) -> dict | None:
        if self._alone is not None:
            if self._alone in self.in_flight:
                return None
            self._alone = None
        if self.last_chance:
            if self.in_flight:
                return None  # let the engine empty, then run it alone
            message = self.last_chance.popleft()
            self._alone = message.msg_id
            return self._hand(message)
        if not self.buffer:
            self._read()
        if self.buffer:
            return self._hand(self.buffer.popleft())
        return None

    def _hand(self, message: Message) -> dict:
        self.in_flight[message.msg_id] = message
        self.metrics.in_flight.set(len(self.in_flight))
        return {**message.request, MSG_KEY: message.msg_id}

    def _room(self) -> int:
        taken = len(self.in_flight) + len(self.buffer) + len(self.last_chance) + len(self.unsent)
        return self.config.max_in_flight - taken

    def _read(self) -> None:
        room = self._room()
        if room <= 0 or not self.backoff.ready():
            return
        busy = bool(self.in_flight)
        now = time.monotonic()
        if busy and now < self._next_poll:
            return
        self._next_poll = now + self.config.busy_poll_s
        try:
            reply = self._call(self.client.xreadgroup, GROUP, self.config.consumer, {self.keys.requests: ">"},
                               count=min(room, 256), block=None if busy else self.config.block_ms)
        except _Unavailable:
            return
        for _stream, entries in reply or []:
            for msg_id, fields in entries:
                self._take_safely(msg_id, fields, deliveries=1)

    def _idle_wait(self) -> None:
        wait = self.backoff.next_try - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, 0.5))

    def _take_safely(self, msg_id: bytes, fields: dict, deliveries: int) -> None:
        try:
            self._take(decode_request(msg_id, fields), deliveries)
        except Exception:  # a bug met by one message must not stop the worker: the message stays pending
            log.exception("could not handle message %s; it stays pending (reclaimed later, then dead-lettered)",
                          text(msg_id))

    def _take(self, message: Message, deliveries: int) -> None:
        """A message just delivered to this worker: to the engine's queue, or answered at once."""
        with self._owned_lock:
            self._owned.add(message.msg_id)
        if deliveries > self.config.max_deliveries:
            reason = (f"delivered {deliveries} times without a result (--max-deliveries {self.config.max_deliveries}): "
                      f"the workers that took it died or their engine failed on it")
            self._dead_letter(message, reason, deliveries)
        elif message.job is None:
            self._dead_letter(message, f"malformed message: {message.error}", deliveries)
        elif message.request is None:
            self.counts["malformed"] += 1
            self.metrics.malformed.inc()
            log.warning("malformed message %s of job %s: %s", message.msg_id, message.job, message.error,
                        extra={"event": "malformed", "message_id": message.msg_id, "job": message.job})
            self._answer(message, [error_result(request_id_of(message), f"malformed message: {message.error}")])
        elif (problem := _unwritable_column(message.request)) is not None:  # a bad row: its error result at once
            extras = {k: v for k, v in message.request.items() if k not in KNOWN_FIELDS}
            self._answer(message, [error_result(message.request.get("id"), problem, extras)])
        elif deliveries >= self.config.max_deliveries and deliveries > 1:
            self.last_chance.append(message)
        else:
            self.buffer.append(message)

    # --- results ------------------------------------------------------------------------------------

    def _on_result(self, result: dict) -> None:
        msg_id = result.pop(MSG_KEY, None)
        message = self.in_flight.get(msg_id)
        if message is None:
            log.error("the engine returned a result for no message of this worker (id %r); dropped", result.get("id"))
            return
        row = _output_row(result)
        self.metrics.observe(row)
        if msg_id not in self.samples_done:
            self.samples_done[msg_id] = (samples_of(message.request, getattr(self.sampling, "n", 1)), [])
        expected, rows = self.samples_done[msg_id]
        rows.append(row)
        if row.get("finish_reason") != "error" and len(rows) < expected:
            return  # the message is answered with all its samples at once
        del self.in_flight[msg_id], self.samples_done[msg_id]
        self.metrics.in_flight.set(len(self.in_flight))
        self._answer(message, rows)

    def _answer(self, message: Message, rows: list[dict]) -> None:
        entries = []
        for row in rows:
            if row.get("finish_reason") == "error":  # (its id may be what made it one: a lone surrogate)
                row = writable(row)
            try:
                entries.append(encode_result(message.msg_id, message.index, self.config.consumer, row, len(rows)))
            except (TypeError, ValueError) as e:  # a value JSON cannot hold
                bad = error_result(row.get("id"), f"the result could not be encoded as JSON: {e}")
                bad["sample_index"] = row.get("sample_index", 0)
                entries.append(encode_result(message.msg_id, message.index, self.config.consumer, bad, len(rows)))
        self.unsent.append(_Answer(message, entries, None, any(r.get("finish_reason") == "error" for r in rows)))
        self._send_unsent()

    def _dead_letter(self, message: Message, reason: str, deliveries: int | None) -> None:
        self.counts["dead_letters"] += 1
        self.metrics.dead_letters.inc()
        log.warning("dead letter %s (job %s): %s", message.msg_id, message.job, reason,
                    extra={"event": "dead_letter", "message_id": message.msg_id, "job": message.job, "reason": reason})
        dead = encode_dead_letter(message, reason, deliveries, self.config.consumer)
        entries = []
        if message.job is not None:
            row = error_result(writable(request_id_of(message)), f"{reason}; the message is in {self.keys.dead}")
            entries.append(encode_result(message.msg_id, message.index, self.config.consumer, row))
        self.unsent.append(_Answer(message, entries, dead, message.job is not None))
        self._send_unsent()

    def _send_unsent(self) -> None:
        while self.unsent and self.backoff.ready():
            answer = self.unsent[0]
            message, job = answer.message, answer.message.job
            try:
                if job is not None and job not in self._registered:
                    self._call(self.client.hsetnx, self.keys.workers(job), self.config.consumer, self.description)
                    self._registered.add(job)
                written = self._call(
                    self._finish,
                    keys=[self.keys.requests, self.keys.results(job) if job else self.keys.dead, self.keys.dead],
                    args=[GROUP, message.msg_id, len(answer.entries),
                          *(item for entry in answer.entries for item in (len(entry), *entry)), *(answer.dead or [])],
                )
            except _Unavailable:
                return
            self.unsent.popleft()
            with self._owned_lock:
                self._owned.discard(message.msg_id)
            if written:
                self.counts["results"] += bool(answer.entries)
                self.counts["errors"] += answer.error
            else:
                self.counts["superseded"] += 1
                self.metrics.superseded.inc()
                log.info("message %s was answered by another worker first; this result is dropped", message.msg_id,
                         extra={"event": "superseded", "message_id": message.msg_id})

    # --- periodic work ------------------------------------------------------------------------------

    def _service(self) -> None:
        """Between engine steps: write waiting results, refresh this worker's messages, reclaim."""
        self._send_unsent()
        now = time.monotonic()
        if now >= self._next_claim and self.backoff.ready() and self._room() > 0:
            self._claim()
        if now >= self._next_stats:
            self._next_stats = now + self.config.stats_every_s
            log.info("worker %s: %s; %d in flight", self.config.consumer,
                     ", ".join(f"{v} {k}" for k, v in self.counts.items() if v), len(self.in_flight),
                     extra={"event": "stats", **self.counts, "in_flight": len(self.in_flight)})

    def _heartbeat(self) -> None:
        """A thread: resets the idle time of this worker's messages every claim_idle_s / 4, so that other
        workers reclaim them only when this process is gone or stuck, however long an engine step takes."""
        interval = max(0.05, self.config.claim_idle_s / 4)
        while not self._beat_stop.wait(interval):
            with self._owned_lock:
                ids = list(self._owned)
            if ids:
                try:
                    self._touch(keys=[self.keys.requests], args=[GROUP, self.config.consumer, 0, 0, *ids])
                except redis.RedisError:
                    pass  # the main thread notices and reports an outage; the next beat tries again

    def _claim(self) -> None:
        """XAUTOCLAIM: messages idle for claim_idle_s (their worker died or was stopped) become ours."""
        try:
            reply = self._call(self.client.xautoclaim, self.keys.requests, GROUP, self.config.consumer,
                               min_idle_time=int(self.config.claim_idle_s * 1000), start_id=self._claim_cursor,
                               count=min(self._room(), 100))
            cursor, entries = text(reply[0]), reply[1]
            counts = {}
            if entries:
                with self.client.pipeline(transaction=False) as pipe:
                    for msg_id, _fields in entries:
                        pipe.xpending_range(self.keys.requests, GROUP, msg_id, msg_id, 1)
                    for (msg_id, _fields), pending in zip(entries, self._call(pipe.execute)):
                        counts[msg_id] = pending[0]["times_delivered"] if pending else 1
        except _Unavailable:
            return
        self._claim_cursor = cursor
        # a full page may have more behind it: look again at once; otherwise after a while
        more = cursor != "0-0"
        self._next_claim = time.monotonic() + (0 if more else max(0.2, min(self.config.claim_idle_s / 2, 15.0)))
        for msg_id, fields in entries:
            if text(msg_id) in self._owned:
                continue  # its own, idle only because Redis was away: the heartbeat has it again
            self.counts["reclaimed"] += 1
            self.metrics.reclaimed.inc()
            log.info("reclaimed %s, delivery %d", text(msg_id), counts[msg_id],
                     extra={"event": "reclaimed", "message_id": text(msg_id), "deliveries": counts[msg_id]})
            self._take_safely(msg_id, fields, counts[msg_id])

    def _give_back(self, ids: list[str], tried: bool) -> None:
        """Makes this worker's pending `ids` claimable by any worker at once. `tried`: this delivery
        counts toward --max-deliveries (the engine failed on them); otherwise (a drain) it does not."""
        if not ids:
            return
        with self._owned_lock:
            self._owned.difference_update(ids)
        idle = int(self.config.claim_idle_s * 1000) + 1000
        try:
            self._touch(keys=[self.keys.requests], args=[GROUP, self.config.consumer, idle, int(not tried), *ids])
        except redis.RedisError as e:
            log.warning("could not hand back %d requests (%s: %s); they are reclaimed after %gs idle", len(ids),
                        type(e).__name__, e, self.config.claim_idle_s)
            return
        self._next_claim = 0.0
        if not tried:
            self.counts["released"] += len(ids)

    # --- start and stop -----------------------------------------------------------------------------

    def _start(self) -> None:
        while not (self.draining.is_set() or self.stop_event.is_set()):
            try:
                self._call(ensure_group, self.client, self.keys)
                return
            except _Unavailable:
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

    # --- Redis calls --------------------------------------------------------------------------------

    def _call(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), or _Unavailable (and a backoff) when Redis does not answer. A group that
        vanished (Redis restarted without its data) is created again."""
        if not self.backoff.ready():
            raise _Unavailable
        try:
            value = fn(*args, **kwargs)
        except FATAL:
            raise
        except redis.RedisError as e:
            self.counts["redis_errors"] += 1
            self.metrics.redis_errors.inc()
            if isinstance(e, redis.ResponseError) and "NOGROUP" in str(e):
                log.warning("the consumer group is gone (Redis lost its data?); creating it again")
                try:
                    ensure_group(self.client, self.keys)
                except redis.RedisError:
                    pass
            delay = self.backoff.failed()
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("redis: %s: %s; retrying with backoff, the engine keeps going", type(e).__name__, e,
                            extra={"event": "redis_unavailable"})
            elif self.backoff.failures % 10 == 0:
                log.warning("redis still unavailable after %.0fs (%s); next try in %.1fs",
                            time.monotonic() - self._down_since, e, delay)
            raise _Unavailable from e
        if self._down_since is not None:
            log.info("redis reachable again after %.1fs; %d finished results waited for it",
                     time.monotonic() - self._down_since, len(self.unsent),
                     extra={"event": "redis_available", "waiting": len(self.unsent)})
            self._down_since = None
            # every worker's messages look idle after an outage: let the heartbeats refresh them first
            self._next_claim = max(self._next_claim, time.monotonic() + self.config.claim_idle_s / 2)
        self.backoff.succeeded()
        return value


def _unwritable_column(request: dict) -> str | None:
    """Why a request's carried-through columns cannot be written (a lone surrogate), or None. The
    engine checks the fields it reads; these it only carries, into a result Redis would refuse."""
    try:
        check_columns_text({k: v for k, v in request.items() if k not in KNOWN_FIELDS})
    except RowError as e:
        return str(e)
    return None


def _output_row(result: dict) -> dict:
    row = dict(result)
    ids = row.get("output_token_ids")
    row["output_token_ids"] = [] if ids is None else [int(t) for t in ids]
    return row

