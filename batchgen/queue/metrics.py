"""Prometheus metrics of a worker, named like vLLM's (`vllm:num_requests_running` ->
`batchgen:num_requests_running`), in a registry of its own (two workers in one process do not share
counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# vLLM's buckets, cut to what a batch job sees.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class WorkerMetrics:
    def __init__(self, llm=None) -> None:
        self.registry = r = CollectorRegistry()
        self._server = None
        engine = getattr(llm, "engine", None)
        scheduler = getattr(engine, "scheduler", None)
        kv = getattr(engine, "kv", None)

        running = Gauge("batchgen:num_requests_running", "Requests in the engine's running batch.", registry=r)
        waiting = Gauge("batchgen:num_requests_waiting", "Requests waiting in the engine to be scheduled.", registry=r)
        kv_usage = Gauge("batchgen:kv_cache_usage_perc", "Share of KV cache token slots in use (1 = full).", registry=r)
        if scheduler is not None:  # read when scraped; len() of a list is safe from the server's thread
            running.set_function(lambda: len(scheduler.running))
            waiting.set_function(lambda: len(scheduler.waiting))
        if kv is not None:
            kv_usage.set_function(lambda: kv.num_used / kv.num_slots if kv.num_slots else 0.0)
        self.in_flight = Gauge("batchgen:queue_requests_in_flight",
                               "Requests this worker took from the stream and has not answered yet.", registry=r)
        self.prompt_tokens = Counter("batchgen:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("batchgen:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.prefix_cache_queries = Counter("batchgen:prefix_cache_queries",
                                            "Prompt tokens of finished requests looked up in the prefix cache.",
                                            registry=r)
        self.prefix_cache_hits = Counter("batchgen:prefix_cache_hits",
                                         "Of them, tokens found in the prefix cache (not computed again).",
                                         registry=r)
        self.request_success = Counter("batchgen:request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("batchgen:time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("batchgen:e2e_request_latency_seconds", "End-to-end request latency in the engine.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("batchgen:request_queue_time_seconds", "Time waiting in the engine.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.dead_letters = Counter("batchgen:dead_letters", "Messages moved to the dead-letter stream.", registry=r)
        self.malformed = Counter("batchgen:malformed_messages", "Messages that were not a usable request.", registry=r)
        self.superseded = Counter("batchgen:results_superseded",
                                  "Results dropped because another worker had answered the request first.", registry=r)
        self.reclaimed = Counter("batchgen:requests_reclaimed", "Requests taken over from other workers.", registry=r)
        self.engine_failures = Counter("batchgen:engine_failures", "Times the engine raised.", registry=r)
        self.redis_errors = Counter("batchgen:redis_errors", "Failed Redis calls (each is retried).", registry=r)

    def observe(self, row: dict) -> None:
        reason = row.get("finish_reason") or "error"
        self.request_success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(row.get("prompt_tokens") or 0)
        self.generation_tokens.inc(row.get("completion_tokens") or 0)
        self.prefix_cache_queries.inc(row.get("prompt_tokens") or 0)
        self.prefix_cache_hits.inc(row.get("cached_prompt_tokens") or 0)
        for histogram, key in ((self.ttft, "ttft_s"), (self.e2e, "e2e_s"), (self.queue_time, "queue_s")):
            if isinstance(row.get(key), (int, float)):
                histogram.observe(row[key])

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serves /metrics on `port` (0: any free port) -> the port."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
