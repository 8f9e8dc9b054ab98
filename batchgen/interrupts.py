"""SIGTERM/SIGINT before a command's own handlers are up (imports, the default model's conversion): an
exception that unwinds what is running, and a memory of it.

Python drops an exception raised inside a callback it runs for its own ends (importlib's module-lock
weakref callback, a __del__), printing "Exception ignored", so the raise alone may be lost: whatever is
about to publish or start work (the conversion's final rename, the command's own handlers) calls
raise_if_dropped() first.
"""

from __future__ import annotations

import signal

_received: list[str] = []  # the start-up signals taken so far


class Interrupted(BaseException):
    """SIGTERM/SIGINT where no command handler took it. Not a KeyboardInterrupt, which Typer would
    turn into exit 130 on its way out."""


def interrupt(signum, frame) -> None:
    """The start-up handler: remember the signal, then unwind."""
    name = signal.Signals(signum).name
    _received.append(name)
    raise Interrupted(name)


def reset() -> None:
    """A command starts with no start-up signal taken."""
    _received.clear()


def raise_if_dropped() -> None:
    """Raise Interrupted for a start-up signal whose exception Python dropped."""
    if _received:
        raise Interrupted(_received[0])
