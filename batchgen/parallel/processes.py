"""Child processes that never outlive their parent: tensor-parallel ranks and data-parallel replicas.

Each child is started with spawn and gets two pipes: `work` (the parent's messages: steps or rows; duplex
when the child answers on it) and `life`, which a thread in the child watches: EOF (the parent exited,
was killed, or closed the group) ends the child at once. The child reports ("ready", payload) when it is
up, ("error", text) before it exits after a failure. A monitor thread in the parent reaps the children
and records why any of them ended unasked: its report, else its exit (a signal, an exit code).

Exit codes: 0 stopped by the parent, 1 failed (its error was reported), 3 the parent went away.
Children are spawned: a script that starts them must do so under `if __name__ == "__main__":`.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

EXIT_STOPPED, EXIT_FAILED, EXIT_PARENT_GONE = 0, 1, 3
STOP_GRACE_S = 10.0  # how long a child has to exit when asked before it is killed


class ChildGroup:
    """The parent's side: starts children `target(index, *args, work, life)` and watches them.

    on_failure(index, reason) is called on the monitor thread, once per child that ends unasked."""

    def __init__(self, target: Callable, args: list[tuple], names: list[str], duplex: bool = False,
                 daemon: bool = True, on_failure: Callable[[int, str], None] = lambda index, reason: None,
                 environments: list[dict] | None = None):
        ctx = mp.get_context("spawn")
        self.failures: dict[int, str] = {}  # child index -> why it ended unasked
        self._on_failure = on_failure
        self._ready: dict[int, object] = {}
        self._ready_event = threading.Condition()
        self._closing = False
        self._lock = threading.Lock()
        self.procs, self.work, self.lives = [], [], []
        for index, (child_args, name) in enumerate(zip(args, names)):
            if duplex:
                here, there = ctx.Pipe()
            else:
                there, here = ctx.Pipe(duplex=False)  # (the child receives, the parent sends)
            life_here, life_there = ctx.Pipe()
            proc = ctx.Process(target=target, name=name, daemon=daemon,
                               args=(index, *child_args, there, life_there))
            with _environment(environments[index] if environments else {}):
                proc.start()
            there.close()  # the child holds the only other ends: EOF reaches it when we go
            life_there.close()
            self.procs.append(proc)
            self.work.append(here)
            self.lives.append(life_here)
        self._monitor = threading.Thread(target=self._watch, name=f"{names[0]}-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, check: Callable[[], None], indices=None) -> dict[int, object]:
        """Wait until every child (of indices) said it is ready, calling check() meanwhile (it raises
        to give up) -> {index: its ready payload}."""
        indices = range(len(self.procs)) if indices is None else indices
        with self._ready_event:
            while not all(i in self._ready or i in self.failures for i in indices):
                self._ready_event.wait(0.1)
                check()
            return {i: self._ready[i] for i in indices if i in self._ready}

    # ---- the monitor thread --------------------------------------------------------------------
    def _record(self, index: int, reason: str) -> None:
        with self._lock:
            if index in self.failures or self._closing:
                return
            self.failures[index] = reason
        with self._ready_event:
            self._ready_event.notify_all()
        self._on_failure(index, reason)

    def _watch(self) -> None:
        lives = {conn: i for i, conn in enumerate(self.lives)}
        sentinels = {p.sentinel: (i, p) for i, p in enumerate(self.procs)}
        while sentinels:
            for ready in wait(list(lives) + list(sentinels)):
                if ready in lives:
                    index = lives[ready]
                    try:
                        kind, payload = ready.recv()
                    except (EOFError, OSError):
                        del lives[ready]
                        continue
                    if kind == "ready":
                        with self._ready_event:
                            self._ready[index] = payload
                            self._ready_event.notify_all()
                    else:
                        self._record(index, payload)
                elif ready in sentinels:
                    index, proc = sentinels.pop(ready)
                    proc.join()
                    reason = describe_exit(proc.exitcode)
                    conn = self.lives[index]
                    if conn in lives:  # a failed child reports before it exits: prefer its words
                        try:
                            while conn.poll(1.0 if proc.exitcode == EXIT_FAILED else 0):
                                kind, payload = conn.recv()
                                if kind == "error":
                                    reason = payload
                                    break
                        except (EOFError, OSError):
                            pass
                        del lives[conn]
                    self._record(index, reason)

    # ---- teardown ------------------------------------------------------------------------------
    def close(self, stop: Callable[[object], None] | None, force: bool = False) -> bool:
        """End the children: each is sent stop(work pipe) and has STOP_GRACE_S to exit (force: killed
        at once); any still running then are killed. -> False if it was closed already."""
        with self._lock:
            if self._closing:
                return False
            self._closing = True
        if not force and stop is not None:
            for conn in self.work:
                try:
                    stop(conn)
                except OSError:
                    pass
            self._monitor.join(STOP_GRACE_S)  # it reaps every child as it exits
        if self._monitor.is_alive():
            for proc in self.procs:
                proc.kill()
        self._monitor.join()
        for proc in self.procs:
            proc.join()
        for conn in self.work + self.lives:
            conn.close()
        return True


class _environment:
    """Set environment variables around a child's start (spawn copies the parent's environment)."""

    def __init__(self, changes: dict):
        self.changes, self.saved = changes, {}

    def __enter__(self):
        for key, value in self.changes.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"its process was killed by {signal.Signals(-code).name}"
    if code == EXIT_FAILED:
        return "it raised an error (see its stderr)"
    return f"its process exited with code {code}"


# ---- in a child ------------------------------------------------------------------------------------
def watch_parent(life) -> None:
    """End this child at once when the parent goes (its end of `life` closes)."""
    def wait_for_eof():
        try:
            while True:
                life.recv()
        except (EOFError, OSError):
            pass
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=wait_for_eof, daemon=True).start()


def report_failure(life, label: str, error: BaseException) -> None:
    """Print the traceback to stderr and send the one-line reason to the parent."""
    print(f"batchgen {label}:", file=sys.stderr)
    traceback.print_exc()
    try:
        life.send(("error", f"{type(error).__name__}: {error}"))
    except OSError:
        pass


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: process groups and CUDA state die with the process
