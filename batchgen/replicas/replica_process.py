"""A data-parallel replica: a child process that runs one LLMEngine on the rows its parent sends, and
sends back each result as it finishes (the messages are listed in replicas/__init__.py)."""
from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Iterator

from batchgen.config import EngineConfig
from batchgen.parallel.processes import (
    EXIT_FAILED,
    EXIT_PARENT_GONE,
    EXIT_STOPPED,
    exit_now,
    report_failure,
    watch_parent,
)


def replica_main(index: int, config: EngineConfig, size: int, work, life) -> None:
    watch_parent(life)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent stops the job; a replica ends with it
        signal.signal(sig, signal.SIG_IGN)
    engine = None
    try:
        from batchgen.engine.engine import LLMEngine

        engine = LLMEngine(config)
        life.send(("ready", engine.describe()))
        inbox: queue.Queue = queue.Queue()
        stop = threading.Event()
        threading.Thread(target=_read_messages, args=(work, inbox, stop), daemon=True).start()
        while True:
            message = inbox.get()
            if message[0] == "close":
                break
            if message[0] != "job":  # (the end or stop of a job that is over)
                continue
            _, defaults, threaded = message
            for result in engine.generate(_rows(inbox, engine), defaults, stop, threaded):
                work.send(("row", (result, engine.generated_tokens)))
            work.send(("done", engine.stats))
    except BaseException as e:
        report_failure(life, f"data-parallel replica {index}", e)
        exit_now(EXIT_FAILED)
    engine.close()
    exit_now(EXIT_STOPPED)


def _read_messages(work, inbox: queue.Queue, stop: threading.Event) -> None:
    """The parent's messages into inbox, in order; "job" clears the stop flag, "stop" raises it."""
    try:
        while True:
            message = work.recv()
            if message[0] == "job":
                stop.clear()
            elif message[0] == "stop":
                stop.set()
            inbox.put(message)
    except (EOFError, OSError):
        exit_now(EXIT_PARENT_GONE)


def _rows(inbox: queue.Queue, engine) -> Iterator[dict | None]:
    """A job's rows as the parent sends them: None while none has come (waiting a moment when the
    engine is idle, so that it does not spin), and the end at "end" or "stop"."""
    while True:
        try:
            message = inbox.get_nowait() if engine.has_work() else inbox.get(timeout=0.01)
        except queue.Empty:
            yield None
            continue
        if message[0] == "rows":
            yield from message[1]
        elif message[0] in ("end", "stop"):
            return
