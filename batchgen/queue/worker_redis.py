"""The worker's Redis calls: each answered, or RedisUnavailable and a backoff, so that an outage slows
the worker without stopping it (a mixin of Worker, whose state Worker.__init__ sets up)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from batchgen.queue.protocol import FATAL, ensure_group

log = logging.getLogger("batchgen.worker")


class RedisUnavailable(Exception):
    """Redis did not answer; the call is retried later (the backoff says when)."""


class RedisCalls:
    """Worker's calls to Redis, with its backoff and outage reports."""

    def _call(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), or RedisUnavailable (and a backoff) when Redis does not answer. A group that
        vanished (Redis restarted without its data) is created again."""
        if not self.backoff.ready():
            raise RedisUnavailable
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
            raise RedisUnavailable from e
        if self._down_since is not None:
            log.info("redis reachable again after %.1fs; %d finished results waited for it",
                     time.monotonic() - self._down_since, len(self.unsent),
                     extra={"event": "redis_available", "waiting": len(self.unsent)})
            self._down_since = None
            # every worker's messages look idle after an outage: let the heartbeats refresh them first
            self._next_claim = max(self._next_claim, time.monotonic() + self.config.claim_idle_s / 2)
        self.backoff.succeeded()
        return value
