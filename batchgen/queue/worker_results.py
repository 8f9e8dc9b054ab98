"""The worker's answers: the engine's results (all samples of a message at once) and dead letters,
each written in one server-side step (protocol.FINISH), kept in memory while Redis is away (a mixin of
Worker, whose state Worker.__init__ sets up)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from batchgen.queue.protocol import GROUP, Message, encode_dead_letter, encode_result, request_id_of
from batchgen.queue.worker_feed import MSG_KEY
from batchgen.queue.worker_redis import RedisUnavailable
from batchgen.sampling_params import samples_of
from batchgen.schema import error_result
from batchgen.unicode_text import writable

log = logging.getLogger("batchgen.worker")


@dataclass
class Answer:
    """A message's answer, waiting in Worker.unsent until Redis takes it."""

    message: Message
    entries: list[list[str]]  # the result stream entries (one per sample); none for a message without a job
    dead: list[str] | None  # the dead-letter stream entry, if it goes there
    error: bool  # an error result


class ResultWriting:
    """Worker's side that turns results into stream entries and writes them."""

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
        self.unsent.append(Answer(message, entries, None, any(r.get("finish_reason") == "error" for r in rows)))
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
        self.unsent.append(Answer(message, entries, dead, message.job is not None))
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
            except RedisUnavailable:
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


def _output_row(result: dict) -> dict:
    row = dict(result)
    ids = row.get("output_token_ids")
    row["output_token_ids"] = [] if ids is None else [int(t) for t in ids]
    return row

