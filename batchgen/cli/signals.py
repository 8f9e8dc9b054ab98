"""SIGTERM/SIGINT while a command runs: unwind at once (exit 75), or, while the engine generates, stop it
within a step so that finished rows are kept."""

from __future__ import annotations

import signal
import sys
import threading

from batchgen.interrupts import raise_if_dropped


class _Signals:
    """SIGTERM/SIGINT: while the engine generates, the first one sets `stop_event` (the engine stops
    within a step, finished rows are saved, exit 75); at any other time, or the second time, it
    interrupts at once (KeyboardInterrupt; finished rows are still saved)."""

    def __init__(self, stop_event: threading.Event) -> None:
        self.stop_event = stop_event
        self.generating = False
        self._previous: dict = {}

    def __enter__(self) -> _Signals:
        raise_if_dropped()  # (a start-up signal whose exception Python dropped: batchgen/interrupts.py)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def on_generation(self, active: bool) -> None:
        self.generating = active

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.generating and not self.stop_event.is_set():
            self.stop_event.set()
            print(f"batchgen: {name}: stopping; finished rows are kept (send it again to stop at once)",
                  file=sys.stderr)
            return
        raise KeyboardInterrupt
