"""The work directory beside OUTPUT (`OUTPUT.partial/`), and resuming from it.

It holds `job.json` (the fingerprint of the settings that shape the output, written before any
result), `part-NNNNNN.parquet` files of finished rows, and `lock`, held (flock) by the run that owns
it so that two runs never write the same job. A rerun of the same command finds the parts, skips
their rows and writes only the rest; a rerun with other settings is refused rather than mixing the
outputs of two different jobs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.sinks import list_parts, read_row_indices, write_atomically

log = logging.getLogger("batchgen")


class JobError(Exception):
    """The job cannot go on; the message says why and what to do."""


def workdir_for(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def describe_difference(old: dict, new: dict) -> str:
    changes = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            changes.append(f"{key}: {json.dumps(old.get(key))} then, {json.dumps(new.get(key))} now")
    return "; ".join(changes)


def output_fingerprint(output: Path) -> dict | None:
    """The fingerprint stored in a finished OUTPUT's metadata, or None if it has none."""
    try:
        meta = pq.read_schema(output).metadata or {}
        return json.loads(meta[b"batchgen"])["fingerprint"]
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return None


class WorkDir:
    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = workdir_for(output)
        self._lock_fd: int | None = None

    def open(self, fingerprint: dict, resume: bool) -> None:
        """Takes the lock; starts a fresh work directory or checks that the leftover one is ours."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobError(f"another batchgen run is writing {self.output} (it holds {self.path}/lock)") from None
        self._lock_fd = fd
        try:
            self._check(fingerprint, resume)
        except BaseException:
            self.close()
            raise

    def _check(self, fingerprint: dict, resume: bool) -> None:
        for tmp in self.path.glob("*.tmp"):
            tmp.unlink()
        job_file = self.path / "job.json"
        if not resume:
            self._clear()
        elif job_file.exists():
            try:
                stored = json.loads(job_file.read_text())["fingerprint"]
            except (ValueError, KeyError, TypeError):
                stored = None
            if stored != fingerprint:
                what = describe_difference(stored, fingerprint) if isinstance(stored, dict) else "unreadable job.json"
                raise JobError(
                    f"{self.path} holds the unfinished rows of a run with other settings ({what}). "
                    f"Rerun with that run's settings to finish it, or pass --no-resume to discard it and start over."
                )
        elif list_parts(self.path):
            raise JobError(f"{self.path} holds rows but no job.json; pass --no-resume to discard them and start over")
        write_atomically(job_file, lambda f: f.write(json.dumps({"fingerprint": fingerprint}, indent=1).encode()))

    def _clear(self) -> None:
        for entry in self.path.iterdir():
            if entry.name == "lock":
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def done_rows(self) -> np.ndarray:
        """A boolean mask over row indices: True where a part already holds the row.

        A part that cannot be read (it should not happen: parts are renamed into place only once
        complete) is set aside as `*.corrupt` and its rows are generated again."""
        done = np.zeros(0, dtype=bool)
        for part in list_parts(self.path):
            try:
                indices = read_row_indices(part)
            except (OSError, pa.ArrowException) as e:
                log.warning("set aside unreadable part %s (%s); its rows will be generated again", part.name, e)
                part.rename(part.with_name(part.name + ".corrupt"))
                continue
            if len(indices) and indices.max() >= len(done):
                done = np.concatenate([done, np.zeros(indices.max() + 1 - len(done), dtype=bool)])
            done[indices] = True
        return done

    def remove(self) -> None:
        """Deletes the work directory (the job is complete)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
