"""Tensor-parallel context, passed to the layers (no process-global state).

An engine's ranks talk through one process group of their own (NCCL on CUDA, captured in CUDA
graphs; gloo over loopback on CPU), made from a rendezvous store that only they know, not
torch.distributed's default group: two engines in one process, or two jobs on one host, never meet.
On GPUs that reach each other directly, small all-reduces (decode steps) go through symmetric
memory instead of NCCL (parallel/symmetric_all_reduce.py).
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from batchgen.parallel.symmetric_all_reduce import max_bytes, open_symmetric, supported_here

TIMEOUT = timedelta(minutes=30)  # a collective that waits longer than this fails
ABORT_WAIT_S = 10.0  # how long abort() blocks its caller (NCCL's own abort waits up to TIMEOUT)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed backend (ProcessGroupNCCL / ProcessGroupGloo) when size > 1
    device: torch.device = torch.device("cpu")  # where the group's tensors live
    symmetric: Any = None  # a SymmetricAllReduce for small CUDA all-reduces, where every rank can use one
    expert_parallel: bool = False  # MoE layers: each rank holds whole experts, not a slice of each (layers/moe.py)
    _aborting: list = field(default_factory=list, compare=False, repr=False)  # the abort thread, once started

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x may be reduce_buffer()'s: its sum is valid until the next product
        writes into that buffer)."""
        if self.symmetric is not None and self.symmetric.fits(x):
            return self.symmetric(x)
        if self.size > 1:
            self.group.allreduce([x]).wait()  # on CUDA: the current stream waits, the host does not
        return x

    def reduce_buffer(self, rows: int, cols: int, dtype: torch.dtype, for_norm: bool = False) -> torch.Tensor | None:
        """Where a product may write the [rows, cols] partial sums it then passes to all_reduce (or, for_norm,
        to all_reduce_add_rmsnorm), to save the symmetric path's copy (parallel/symmetric_all_reduce.py);
        None: anywhere."""
        return self.symmetric.staging(rows, cols, dtype, for_norm) if self.symmetric is not None else None

    def defers_sum(self, partials: torch.Tensor) -> bool:
        """A row-parallel product's partial sums may go unsummed to the add + RMSNorm after it, which
        sums them in its own kernel (all_reduce_add_rmsnorm): they lie in the symmetric buffer."""
        return self.symmetric is not None and self.symmetric.takes_partials(partials)

    def all_reduce_add_rmsnorm(self, partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum + residual), sum + residual) of partials that defers_sum() took; the residual
        is right on this rank's share of the rows at least (parallel/symmetric_all_reduce.py)."""
        return self.symmetric.all_reduce_add_rmsnorm(partials, residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x on each rank -> [size, *x.shape], rank-major."""
        if self.size == 1:
            return x[None]
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        self.group.allgather([list(out.unbind(0))], [x]).wait()
        return out

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank-major."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x to every rank, in place."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            self.group.broadcast([x], opts).wait()
        return x

    def min_over_ranks(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    @property
    def all_reduce_path(self) -> str:
        if self.size == 1:
            return "none"
        if self.device.type != "cuda":
            return "gloo"
        if self.symmetric is None:
            return "NCCL"
        return f"symmetric memory up to {max_bytes(self.size) >> 20} MiB of bf16, NCCL above"

    def close_symmetric(self) -> None:
        """After the CUDA graphs that captured it are freed."""
        if self.symmetric is not None:
            self.symmetric.close()

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({self.size})")
        return total // self.size

    def abort(self, wait_s: float = ABORT_WAIT_S) -> None:
        """Fail every collective in flight or to come (another rank is gone): NCCL kernels waiting
        for a dead peer return instead of spinning forever; then free the communicators.

        NCCL's abort raises its flag at once but returns only when no live CUDA graph holds the
        communicator any more, so it runs on a thread of its own (started once) and the caller
        waits at most wait_s: a caller that then frees the graphs lets it finish."""
        if self.group is None or not hasattr(self.group, "abort"):
            return
        with _abort_lock:
            if not self._aborting:
                thread = threading.Thread(
                    target=_abort_quietly, args=(self.group,), name="batchgen-tp-abort", daemon=True
                )
                self._aborting.append(thread)
                thread.start()
        self._aborting[0].join(wait_s)


SINGLE = TensorParallel()
_abort_lock = threading.Lock()


def _abort_quietly(group) -> None:
    try:
        group.abort()
    except Exception:  # best effort: the engine is ending or failing anyway
        pass


def connect(store_path: str, rank: int, size: int, device: torch.device,
            symmetric_all_reduce: bool = True) -> TensorParallel:
    """Join the engine's ranks through the FileStore at store_path (every rank calls this, with the same
    symmetric_all_reduce: EngineConfig's; False keeps every all-reduce on NCCL)."""
    store = dist.PrefixStore("tp", dist.FileStore(store_path, size))
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        group = ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # the ranks share one host
        group = dist.ProcessGroupGloo(store, rank, size, opts)
    if hasattr(group, "_set_sequence_number_for_group"):
        group._set_sequence_number_for_group()
    tp = TensorParallel(rank, size, group, device)
    if device.type == "cuda" and tp.min_over_ranks(int(symmetric_all_reduce and supported_here(rank, size, device))):
        max_programs = tp.min_over_ranks(torch.cuda.get_device_properties(device).multi_processor_count)
        symmetric = open_symmetric(store, rank, size, device, group, store_path, max_programs)
        tp = dataclasses.replace(tp, symmetric=symmetric)
    return tp
