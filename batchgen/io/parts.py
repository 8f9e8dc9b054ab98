"""Part files: finished results are buffered and every `flush_rows` rows or `flush_seconds` seconds
written as `part-NNNNNN.parquet` in the work directory (temp name, fsync, rename), so a crash loses at
most the last few seconds of results and `resume` knows exactly which rows are done. Also the atomic
writes and the write errors that name their file, which the final files use too.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq

from batchgen.io.layout import Layout


def part_number(path: Path) -> int:
    return int(path.name[len("part-") : -len(".parquet")])


def list_parts(workdir: Path) -> list[Path]:
    parts = [p for p in workdir.glob("part-*.parquet") if p.name[5:-8].isdigit()]
    return sorted(parts, key=part_number)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputWriteError(Exception):
    """A file of the job's output could not be written (a full disk, no permission); the message
    names the file."""


@contextmanager
def writing(path: Path, tmp: Path | None = None):
    """Turns an OSError in the block into an OutputWriteError that names `path`, and removes `tmp`
    (a file half written, which would hold the space a full disk needs)."""
    try:
        yield
    except OSError as e:
        raise write_error(path, e, tmp) from e


def write_error(path: Path, error: OSError, tmp: Path | None = None) -> OutputWriteError:
    if tmp is not None:
        tmp.unlink(missing_ok=True)
    return OutputWriteError(f"cannot write {path}: {error.strerror or ' '.join(str(error).split())}")


def write_atomically(path: Path, write) -> None:
    """Calls write(file) on `path`.tmp, fsyncs it, renames it to `path` and fsyncs the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)


class PartWriter:
    """Buffers finished results and writes them out as part files.

    `add` may be called from the engine's request-pulling code as well as from the result loop, so
    the buffer is guarded by a lock.
    """

    def __init__(self, workdir: Path, layout: Layout, flush_rows: int = 1000, flush_seconds: float = 5.0) -> None:
        self.workdir = workdir
        self.layout = layout
        self.flush_rows = max(1, flush_rows)
        self.flush_seconds = flush_seconds
        existing = list_parts(workdir)
        self._next_part = part_number(existing[-1]) + 1 if existing else 1
        self._buffer: list[dict] = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, row: dict) -> None:
        with self._lock:
            self._buffer.append(row)
            if len(self._buffer) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        table = self.layout.part_table(self._buffer)
        path = self.workdir / f"part-{self._next_part:06d}.parquet"
        write_atomically(path, lambda f: pq.write_table(table, f))
        self._next_part += 1
        self.rows_written += len(self._buffer)
        self._buffer.clear()
