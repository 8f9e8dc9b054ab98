"""A start-up SIGTERM whose exception Python dropped (raised inside a callback Python runs for its own ends,
such as importlib's module-lock weakref callback: "Exception ignored in ...") still stops the command: the
handlers a command installs next, and the default model's conversion before it publishes, raise it again,
so `run` exits 75 instead of running the job."""

from __future__ import annotations

import gc
import signal
import threading
import weakref

import pytest

from batchgen import interrupts
from batchgen.cli.signals import _Signals
from batchgen.interrupts import Interrupted


class _Owner:
    pass


def _drop_startup_sigterm() -> None:
    """The start-up handler runs inside a weakref callback: Python prints the exception and goes on."""
    owner = _Owner()
    ref = weakref.ref(owner, lambda _: interrupts.interrupt(signal.SIGTERM, None))
    del owner
    gc.collect()
    assert ref() is None


@pytest.fixture(autouse=True)
def fresh():
    interrupts.reset()
    yield
    interrupts.reset()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the dropped raise)
def test_the_command_handlers_raise_a_dropped_startup_signal_again():
    previous = signal.getsignal(signal.SIGTERM)
    _drop_startup_sigterm()
    with pytest.raises(Interrupted, match="SIGTERM"):
        with _Signals(threading.Event()):
            pytest.fail("the job would run")
    assert signal.getsignal(signal.SIGTERM) is previous  # the command's handlers are taken down again


def test_no_startup_signal_lets_the_command_run():
    with _Signals(threading.Event()) as installed:
        assert signal.getsignal(signal.SIGTERM) == installed._handle


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the dropped raise)
def test_the_conversion_does_not_publish_after_a_dropped_startup_signal(tmp_path, monkeypatch):
    from batchgen.models.default_model import ensure_default_model

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    _drop_startup_sigterm()
    with pytest.raises(Interrupted, match="SIGTERM"):
        ensure_default_model()
    assert list((tmp_path / "models").iterdir()) == []  # neither the model nor its .converting-* directory
