"""An LLM whose job stops right after its first result, as the CLI's SIGTERM handler would stop it."""
from __future__ import annotations

import threading


class StopAfterFirstResult:
    """The LLM, with a stop (as the CLI's SIGTERM handler sets it) right after its first result."""

    def __init__(self, llm, stop_event: threading.Event) -> None:
        self.llm, self.stop_event = llm, stop_event

    def generate(self, requests, sampling=None, stop_event=None):
        for result in self.llm.generate(requests, sampling, stop_event):
            yield result
            self.stop_event.set()

    def __getattr__(self, name):
        return getattr(self.llm, name)
