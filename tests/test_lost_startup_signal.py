"""A start-up SIGTERM whose exception Python dropped (raised inside a callback Python runs for its own ends,
such as importlib's module-lock weakref callback: "Exception ignored in ...") still stops the command: the
handlers a command installs next raise it again, so `run` exits 75 instead of running the job."""

from __future__ import annotations

import gc
import signal
import threading
import weakref

import pytest

from batchgen.cli import signals
from batchgen.cli.signals import _Interrupted, _Signals


class _Owner:
    pass


def _drop_startup_sigterm() -> None:
    """The start-up handler runs inside a weakref callback: Python prints the exception and goes on."""
    owner = _Owner()
    ref = weakref.ref(owner, lambda _: signals._interrupt(signal.SIGTERM, None))
    del owner
    gc.collect()
    assert ref() is None


@pytest.fixture(autouse=True)
def fresh():
    signals._reset_startup_signals()
    yield
    signals._reset_startup_signals()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the dropped raise)
def test_the_command_handlers_raise_a_dropped_startup_signal_again():
    previous = signal.getsignal(signal.SIGTERM)
    _drop_startup_sigterm()
    with pytest.raises(_Interrupted, match="SIGTERM"):
        with _Signals(threading.Event()):
            pytest.fail("the job would run")
    assert signal.getsignal(signal.SIGTERM) is previous  # the command's handlers are taken down again


def test_no_startup_signal_lets_the_command_run():
    with _Signals(threading.Event()) as installed:
        assert signal.getsignal(signal.SIGTERM) == installed._handle
