"""The work directory beside OUTPUT (`OUTPUT.partial/`), and resuming from it.

It holds `job.json` (the fingerprint of the settings that shape the output, written before any
result), `part-NNNNNN.parquet` files of finished rows, and `lock`, held (flock) by the run that owns
it so that two runs never write the same job. A rerun of the same command finds the parts, skips
their rows and writes only the rest; a rerun with other settings is refused rather than mixing the
outputs of two different jobs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.parts import list_parts, write_atomically
from batchgen.io.sinks import read_row_keys

log = logging.getLogger("batchgen")


class JobError(Exception):
    """The job cannot go on; the message says why and what to do."""


def workdir_for(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


FULL_HASH_BYTES = 64 << 20  # inputs up to this size are hashed whole (~0.1 s); larger ones by their ends
END_BYTES = 1 << 20


def input_identity(path: Path) -> dict:
    """What resume knows the input by: name, size, mtime and a digest of its content (all of it, or
    for a file over FULL_HASH_BYTES its first and last MiB), so that an input edited in place, even to
    the same size and with its mtime put back, is not taken for the one the leftover rows came from."""
    stat = path.stat()
    digest = hashlib.blake2b(str(stat.st_size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if stat.st_size <= FULL_HASH_BYTES:
            while chunk := f.read(END_BYTES):
                digest.update(chunk)
        else:
            digest.update(f.read(END_BYTES))
            f.seek(-END_BYTES, os.SEEK_END)
            digest.update(f.read(END_BYTES))
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "blake2b": digest.hexdigest()}


def _as_stored(stored: dict, fingerprint: dict) -> dict:
    """`fingerprint` as a batchgen that stored `stored` would have made it: without the input digest
    if that one had none (so that its leftover or finished output stays usable after an upgrade)."""
    current_input, stored_input = fingerprint.get("input"), stored.get("input")
    if isinstance(current_input, dict) and isinstance(stored_input, dict) and "blake2b" not in stored_input:
        return {**fingerprint, "input": {k: v for k, v in current_input.items() if k != "blake2b"}}
    return fingerprint


def same_job(stored: dict | None, fingerprint: dict) -> bool:
    """Whether a stored fingerprint is this job's."""
    return isinstance(stored, dict) and stored == _as_stored(stored, fingerprint)


def describe_difference(old: dict, new: dict) -> str:
    """`max_tokens: 16 then, 13 now; input.size: 10 then, 12 now`."""
    new = _as_stored(old, new)
    changes = []
    for key in sorted(set(old) | set(new)):
        then, now = old.get(key), new.get(key)
        if then == now:
            continue
        if isinstance(then, dict) and isinstance(now, dict):
            changes += [f"{key}.{k}: {json.dumps(then.get(k))} then, {json.dumps(now.get(k))} now"
                        for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]
        else:
            changes.append(f"{key}: {json.dumps(then)} then, {json.dumps(now)} now")
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
        """Takes the lock; starts a fresh work directory or checks that the leftover one is ours. A path
        there that batchgen did not make (a file, or a directory with files but no lock, job.json or
        parts) is refused: the work directory is emptied and deleted, and whatever else was in it with it."""
        if self.path.exists() and not self.path.is_dir():
            raise JobError(f"{self.path} is in the way: batchgen keeps OUTPUT's unfinished rows there; move it "
                           "away or choose another OUTPUT")
        if self.path.is_dir() and any(self.path.iterdir()) and not self._made_by_batchgen():
            raise JobError(f"{self.path} is not a batchgen work directory (no lock, job.json or parts), and "
                           "batchgen would delete what it holds; move it away or choose another OUTPUT")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise JobError(f"cannot make the work directory {self.path}: {e.strerror or e}") from None
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

    def _made_by_batchgen(self) -> bool:
        return (self.path / "lock").exists() or (self.path / "job.json").exists() or bool(list_parts(self.path))

    def _check(self, fingerprint: dict, resume: bool) -> None:
        for tmp in self.path.glob("*.tmp"):
            tmp.unlink()
        job_file = self.path / "job.json"
        if not resume:
            self._clear()
        elif job_file.exists():
            stored = self.stored_fingerprint()
            if not same_job(stored, fingerprint):
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

    def stored_fingerprint(self) -> dict | None:
        """The fingerprint of the run that made this work directory (None: none, or unreadable)."""
        try:
            stored = json.loads((self.path / "job.json").read_text())["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return stored if isinstance(stored, dict) else None

    def done_rows(self) -> DoneRows:
        """What the parts hold already, per input row.

        A part that cannot be read (it should not happen: parts are renamed into place only once
        complete) is set aside as `*.corrupt` and its rows are generated again."""
        found = []
        for part in list_parts(self.path):
            try:
                found.append(read_row_keys(part))
            except (OSError, pa.ArrowException) as e:
                log.warning("set aside unreadable part %s (%s); its rows will be generated again", part.name, e)
                part.rename(part.with_name(part.name + ".corrupt"))
        return DoneRows(*(np.concatenate(c) for c in zip(*found)) if found else ())

    def remove(self) -> None:
        """Deletes the work directory (the job is complete)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class DoneRows:
    """The results an earlier run saved: per input row index, which of its samples are done. A row
    is done when all its n samples are, or when it has an error result (one for the whole row).
    `counts`: each result's row's n (1 where unknown)."""

    def __init__(self, indices=None, samples=None, errors=None, counts=None) -> None:
        if indices is None:
            indices = samples = np.zeros(0, dtype=np.int64)
            errors = np.zeros(0, dtype=bool)
        if counts is None:
            counts = np.ones(len(indices), dtype=np.int64)
        size = int(indices.max()) + 1 if len(indices) else 0
        self.any = np.zeros(size, dtype=bool)  # rows with some result
        self.any[indices] = True
        self.failed = np.zeros(size, dtype=bool)  # rows with an error result
        self.failed[indices[errors]] = True
        # the samples done of rows with a sample other than 0 (the few rows of n > 1 jobs: a dict)
        self.samples: dict[int, set[int]] = {}
        several = np.zeros(size, dtype=bool)
        several[indices[samples > 0]] = True
        for index, sample in zip(indices[several[indices]].tolist(), samples[several[indices]].tolist()):
            self.samples.setdefault(index, set()).add(sample)
        # rows of n > 1 samples with some of them still to generate
        sampled = dict(zip(indices[counts > 1].tolist(), counts[counts > 1].tolist()))
        self.partial = sum(1 for index, n in sampled.items() if self.missing(index, n))

    @property
    def num_rows(self) -> int:
        """Rows done: a rerun generates nothing more of them."""
        return int(self.any.sum()) - self.partial

    def has_any(self, index: int) -> bool:
        return index < len(self.any) and bool(self.any[index])

    def missing(self, index: int, n: int) -> list[int]:
        """Sample indices of row `index` (of n samples) still to generate; [] when it is done."""
        if not self.has_any(index):
            return list(range(n))
        if self.failed[index]:
            return []
        done = self.samples.get(index, {0})
        return [i for i in range(n) if i not in done]
