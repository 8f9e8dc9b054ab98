"""Optional dependencies (pyproject.toml's extras): a missing one is a one-line error that names the
extra to install, instead of a bare "No module named 'redis'"."""

from __future__ import annotations

EXTRA_OF = {"redis": "queue", "prometheus_client": "queue", "xgrammar": "structured", "ray": "ray"}
_WHAT = {"queue": "the queue", "structured": "constrained decoding", "ray": "the Ray stage"}


def extra_hint(extra: str) -> str:
    """'the queue needs batchgen[queue]: pip install 'batchgen[queue]''"""
    return f"{_WHAT[extra]} needs batchgen[{extra}]: pip install 'batchgen[{extra}]'"


class MissingExtra(ModuleNotFoundError):
    """`module`, an optional dependency, is not installed; the message names its extra."""

    def __init__(self, module: str):
        super().__init__(extra_hint(EXTRA_OF[module]), name=module)
