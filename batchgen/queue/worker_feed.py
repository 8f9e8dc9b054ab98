"""The worker's intake: the feed of requests the engine pulls from (XREADGROUP), reclaiming the
messages of silent workers (XAUTOCLAIM), keeping this worker's own messages fresh (the heartbeat) and
handing them back (a mixin of Worker, whose state Worker.__init__ sets up)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import redis

from batchgen.io.rows import RowError, check_columns_text
from batchgen.queue.protocol import GROUP, Message, decode_request, request_id_of, text
from batchgen.queue.worker_redis import RedisUnavailable
from batchgen.schema import KNOWN_FIELDS, error_result

log = logging.getLogger("batchgen.worker")

MSG_KEY = "__batchgen_msg__"  # carried through the engine: which message a result answers


class MessageIntake:
    """Worker's side that takes messages from the stream and hands them to the engine."""

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
        except RedisUnavailable:
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
        except RedisUnavailable:
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


def _unwritable_column(request: dict) -> str | None:
    """Why a request's carried-through columns cannot be written (a lone surrogate), or None. The
    engine checks the fields it reads; these it only carries, into a result Redis would refuse."""
    try:
        check_columns_text({k: v for k, v in request.items() if k not in KNOWN_FIELDS})
    except RowError as e:
        return str(e)
    return None
