"""Exit codes and one-line errors: every failure of a command ends as one line on stderr and an exit code."""

from __future__ import annotations

import sys

import typer

from batchgen.config import debug

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_ROW_ERRORS, EXIT_INTERRUPTED = 0, 1, 2, 65, 75

# Click's exception classes, wherever this Typer keeps them (newer Typers vendor their own Click).
_ClickException, _UsageError = (
    next(c for c in typer.BadParameter.__mro__ if c.__name__ == name) for name in ("ClickException", "UsageError")
)


def _fail(message: str, code: int = EXIT_FAILURE) -> typer.Exit:
    print(f"batchgen: error: {' '.join(str(message).split())}", file=sys.stderr)
    return typer.Exit(code)


def _unexpected(error: Exception) -> typer.Exit:
    """A failure no command foresaw (a bug, or the machine ran out of something): one line, as every
    other error; the traceback with BATCHGEN_DEBUG=1."""
    if debug():
        raise error
    return _fail(f"{type(error).__name__}: {error} (set BATCHGEN_DEBUG=1 for the traceback)")


class _BadSetting(Exception):
    """An engine option the engine refused (ValueError) or a model it could not find."""
