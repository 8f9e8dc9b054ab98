"""Tensor-parallel worker processes and the per-step hand-off.

Rank 0 is the calling process: it owns the scheduler, the tokenizer and sampling. Ranks 1..N-1 are
processes started here (spawn), one per GPU (rank r on cuda:r; NCCL), or CPU processes (gloo). Every
rank builds the same ModelRunner over its own shards. Each step rank 0 writes the step's packed
StepInputs to a pipe per worker; every rank stages them, runs the forward (the collectives inside),
and the workers receive rank 0's sampled tokens by a broadcast on the device.

No orphans, whatever ends the job:
- a worker watches a pipe from the parent on a thread; EOF (the parent exited, was killed, or tore
  the workers down) ends the worker at once;
- a worker that fails reports its error on that pipe and exits; the parent's monitor thread sees the
  report or the exit and aborts the NCCL collectives (no rank then waits forever on a dead peer), and
  the engine raises TensorParallelError naming the rank and the reason, after ending the other
  workers;
- the parent ends its workers when the engine is closed or collected, and at interpreter exit.

Worker exit codes: 0 stopped by the parent, 1 failed (its error was reported to the parent), 3 the
parent went away. The ranks meet through a FileStore in a fresh temporary directory: no ports and no
fixed names, so two jobs on one host never collide.

Processes are started with spawn: a script that builds an LLM with tensor_parallel_size > 1 must do
so under `if __name__ == "__main__":`, as with any multiprocessing program.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import torch

from batchgen.config import EngineConfig
from batchgen.forward.parallel import TensorParallel, connect
from batchgen.executor.step_inputs import StepInputs

EXIT_STOPPED, EXIT_FAILED, EXIT_PARENT_GONE = 0, 1, 3
STOP = b""  # the step message that ends a worker
FAILURE_GRACE_S = 3.0  # how long rank 0 waits for a worker's report after one of its collectives failed
STOP_GRACE_S = 10.0  # how long a worker has to exit before it is killed


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the message says which and why."""


def tp_device(config: EngineConfig) -> torch.device:
    """The device type of every rank; on CUDA, checks that there is a GPU per rank."""
    from batchgen.executor.memory import resolve_device

    device = resolve_device(config.device)
    size = config.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"invalid --tensor-parallel-size: {size} needs {size} GPUs, {torch.cuda.device_count()} visible"
        )
    return device


class TPWorkers:
    """Rank 0's side: starts ranks 1..N-1 and joins them in a TensorParallel (`self.tp`)."""

    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device):
        size = config.tensor_parallel_size
        self.device = device
        self.tmpdir = tempfile.mkdtemp(prefix="batchgen-tp-")
        store_path = os.path.join(self.tmpdir, "store")
        self.failure: str | None = None
        self._failed = threading.Event()
        self._ready = threading.Semaphore(0)
        self._closing = False
        self._lock = threading.Lock()
        self.tp: TensorParallel | None = None
        self.release_graphs: Callable[..., None] | None = None  # see runner_ready
        self.rank0_polls = False
        ctx = mp.get_context("spawn")
        self.procs, self.steps, self.lives = [], [], []
        for rank in range(1, size):
            steps_out, steps_in = ctx.Pipe(duplex=False)
            life_here, life_there = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, name=f"batchgen-tp-rank{rank}", daemon=True,
                args=(rank, size, store_path, config, str(model_dir), device.type, steps_out, life_there),
            )
            proc.start()
            steps_out.close()  # the worker holds the only other ends: EOF reaches it when we go
            life_there.close()
            self.procs.append(proc)
            self.steps.append(steps_in)
            self.lives.append(life_here)
        self._monitor = threading.Thread(target=self._watch, name="batchgen-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            for _ in self.procs:  # every worker up (imports done) before we wait on the store for them
                while not self._ready.acquire(timeout=0.1):
                    self.check()
            if device.type == "cuda":
                torch.cuda.set_device(0)
                device = torch.device("cuda", 0)
            self.tp = connect(store_path, 0, size, device)
        except BaseException as e:
            self.fail(e)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def runner_ready(self, release_graphs: Callable[..., None] | None) -> None:
        """Rank 0's runner is built. release_graphs frees its CUDA graphs (close() must, before NCCL
        can free the communicators). From now on rank 0 never blocks on the device but polls
        check(), so the monitor leaves the abort to close(): NCCL's abort holds the group's lock
        until the graphs are freed, and a collective that rank 0 launched meanwhile would wait on it."""
        self.release_graphs = release_graphs
        self.rank0_polls = True

    # ---- per step ------------------------------------------------------------------------------
    def send(self, inputs: StepInputs) -> None:
        data = memoryview(inputs.packed.numpy())
        for conn in self.steps:
            conn.send_bytes(data)

    def check(self) -> None:
        """Raise if a worker failed."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def fail(self, error: BaseException):
        """Rank 0 hit `error` while the ranks worked together: end the workers and raise the cause.
        A collective that failed here (a RuntimeError or a broken pipe) is usually the echo of a
        worker that failed first: its report, if one comes, is the error raised. Any other error of
        rank 0 is raised as it is."""
        echo = isinstance(error, (RuntimeError, OSError, EOFError)) and not isinstance(error, TensorParallelError)
        if echo:
            self._failed.wait(FAILURE_GRACE_S)
        self.close(force=True)
        if echo and self.failure is not None:
            raise TensorParallelError(self.failure) from error
        raise error

    # ---- the monitor thread --------------------------------------------------------------------
    def _record(self, rank: int, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = f"tensor-parallel rank {rank} failed: {reason}"
        self._failed.set()
        if self.tp is not None and self.device.type == "cuda" and not self.rank0_polls:
            self.tp.abort(wait_s=0)  # NCCL kernels waiting for the dead rank return instead of hanging

    def _watch(self) -> None:
        lives = {conn: rank for rank, conn in enumerate(self.lives, start=1)}
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while sentinels:
            for ready in wait(list(lives) + list(sentinels)):
                if ready in lives:
                    rank = lives[ready]
                    try:
                        kind, text = ready.recv()
                    except (EOFError, OSError):
                        del lives[ready]
                        continue
                    if kind == "ready":
                        self._ready.release()
                    else:
                        self._record(rank, text)
                elif ready in sentinels:
                    rank, proc = sentinels.pop(ready)
                    proc.join()
                    reason = _describe_exit(proc.exitcode)
                    conn = self.lives[rank - 1]
                    if conn in lives:  # a failed worker reports before it exits: prefer its words
                        try:
                            while conn.poll(1.0 if proc.exitcode == EXIT_FAILED else 0):
                                kind, text = conn.recv()
                                if kind == "error":
                                    reason = text
                                    break
                        except (EOFError, OSError):
                            pass
                        del lives[conn]
                    self._record(rank, reason)

    # ---- teardown ------------------------------------------------------------------------------
    def close(self, force: bool = False) -> None:
        """End the workers: idle ones are asked to stop, and any still running after STOP_GRACE_S
        (or at once with force, after a failure) are killed. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        force = force or self.failure is not None
        if not force:
            for conn in self.steps:
                try:
                    conn.send_bytes(STOP)
                except OSError:
                    pass
            self._monitor.join(STOP_GRACE_S)  # it reaps every worker as it exits
        if self._monitor.is_alive():
            for proc in self.procs:
                proc.kill()
        self._monitor.join()
        for proc in self.procs:
            proc.join()
        for conn in self.steps + self.lives:
            conn.close()
        nccl = self.tp is not None and self.device.type == "cuda"
        if nccl and self.failure is not None:
            self.tp.abort(wait_s=0)  # raises NCCL's flag: kernels waiting for the dead rank return
        if self.release_graphs is not None:  # NCCL's abort ends only once no graph holds the group
            self.release_graphs(wait=not force)
        if self.tp is not None:
            self.tp.close_symmetric()
        if nccl or (self.tp is not None and self.failure is not None):
            self.tp.abort()  # free rank 0's communicators without waiting on peers that are gone
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"its process was killed by {signal.Signals(-code).name}"
    if code == EXIT_FAILED:
        return "it raised an error (see its stderr)"
    return f"its process exited with code {code}"


# ---- a worker process ----------------------------------------------------------------------------
def _exit_when_parent_goes(life) -> None:
    try:
        while True:
            life.recv()
    except (EOFError, OSError):
        pass
    os._exit(EXIT_PARENT_GONE)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: process groups and CUDA state die with the process


def worker_main(rank, size, store_path, config, model_dir, device_type, steps, life) -> None:
    threading.Thread(target=_exit_when_parent_goes, args=(life,), daemon=True).start()
    try:
        from batchgen.executor.model_runner import ModelRunner
        from batchgen.models.model_config import load_model_config

        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            device = torch.device("cpu")
        life.send(("ready", None))
        tp = connect(store_path, rank, size, device)
        model_dir = Path(model_dir)
        runner = ModelRunner(config, model_dir, load_model_config(model_dir), tp)
        tokens = None  # the last step's sampled tokens, on the device
        while True:
            data = steps.recv_bytes()
            if data == STOP:
                break
            if len(data) % 8:
                raise ValueError(f"a step message of {len(data)} bytes is not a whole number of int64 values")
            inputs = StepInputs.unpack(torch.frombuffer(bytearray(data), dtype=torch.int64))
            tokens = runner.follow(inputs, tokens)
    except EOFError:
        _exit(EXIT_PARENT_GONE)
    except BaseException as e:
        print(f"batchgen tensor-parallel rank {rank}:", file=sys.stderr)
        traceback.print_exc()
        try:
            life.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        _exit(EXIT_FAILED)
    _exit(EXIT_STOPPED)
