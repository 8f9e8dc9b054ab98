"""Tensor-parallel worker processes and the per-step hand-off.

Rank 0 is the calling process: it owns the scheduler, the tokenizer and sampling. Ranks 1..N-1 are
children (parallel/processes.py: they never outlive it), one per GPU (rank r on cuda:r; NCCL), or CPU
processes (gloo). Every rank builds the same ModelRunner over its own shards. Each step rank 0 writes the
step's packed StepInputs to a pipe per worker; every rank stages them, runs the forward (the collectives
inside), and the workers receive rank 0's sampled tokens by a broadcast on the device.

A worker that fails reports its error and exits; the monitor aborts the NCCL collectives (no rank then
waits forever on a dead peer), and the engine raises TensorParallelError naming the rank and the reason,
after ending the other workers. The parent ends its workers when the engine is closed or collected, and
at interpreter exit. The ranks meet through a FileStore in a fresh temporary directory: no ports and no
fixed names, so two jobs on one host never collide.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.config import EngineConfig
from batchgen.executor.step_inputs import StepInputs
from batchgen.parallel.processes import (
    EXIT_FAILED,
    EXIT_PARENT_GONE,
    EXIT_STOPPED,
    ChildGroup,
    exit_now,
    report_failure,
    watch_parent,
)
from batchgen.parallel.tensor_parallel import TensorParallel, connect

STOP = b""  # the step message that ends a worker
FAILURE_GRACE_S = 3.0  # how long rank 0 waits for a worker's report after one of its collectives failed


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
        self.tp: TensorParallel | None = None
        self.release_graphs: Callable[..., None] | None = None  # see runner_ready
        self.rank0_polls = False
        self.children = ChildGroup(
            worker_main, [(size, store_path, config, str(model_dir), device.type) for _ in range(1, size)],
            [f"batchgen-tp-rank{rank}" for rank in range(1, size)], on_failure=self._record,
        )
        self.procs, self.steps = self.children.procs, self.children.work
        try:
            self.children.wait_ready(self.check)  # every worker up (imports done) before we wait on the store
            self.check()
            if device.type == "cuda":
                torch.cuda.set_device(0)
                device = torch.device("cuda", 0)
            self.tp = connect(store_path, 0, size, device, config.symmetric_all_reduce)
        except BaseException as e:
            self.fail(e)

    @property
    def pids(self) -> list[int]:
        return self.children.pids

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
    def _record(self, index: int, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = f"tensor-parallel rank {index + 1} failed: {reason}"
        self._failed.set()
        if self.tp is not None and self.device.type == "cuda" and not self.rank0_polls:
            self.tp.abort(wait_s=0)  # NCCL kernels waiting for the dead rank return instead of hanging

    # ---- teardown ------------------------------------------------------------------------------
    def close(self, force: bool = False) -> None:
        """End the workers: idle ones are asked to stop, and any still running after a grace period
        (or at once with force, after a failure) are killed. Idempotent."""
        force = force or self.failure is not None
        if not self.children.close(lambda conn: conn.send_bytes(STOP), force):
            return
        nccl = self.tp is not None and self.device.type == "cuda"
        if nccl and self.failure is not None:
            self.tp.abort(wait_s=0)  # raises NCCL's flag: kernels waiting for the dead rank return
        if self.release_graphs is not None:  # NCCL's abort ends only once no graph holds the group
            self.release_graphs(wait=not force)
            self.release_graphs = None  # (it holds the graphs, which hold the model and the KV pool)
        if self.tp is not None:
            self.tp.close_symmetric()
        if nccl or (self.tp is not None and self.failure is not None):
            self.tp.abort()  # free rank 0's communicators without waiting on peers that are gone
        shutil.rmtree(self.tmpdir, ignore_errors=True)


# ---- a worker process ----------------------------------------------------------------------------
def worker_main(index, size, store_path, config, model_dir, device_type, steps, life) -> None:
    rank = index + 1
    watch_parent(life)
    try:
        from batchgen.executor.model_runner import ModelRunner
        from batchgen.models.model_config import load_model_config

        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:  # (the runner sets the thread count: model_runner.cpu_threads_of)
            device = torch.device("cpu")
        life.send(("ready", None))
        tp = connect(store_path, rank, size, device, config.symmetric_all_reduce)
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
        exit_now(EXIT_PARENT_GONE)
    except BaseException as e:
        report_failure(life, f"tensor-parallel rank {rank}", e)
        exit_now(EXIT_FAILED)
    exit_now(EXIT_STOPPED)
