"""All-reduces through symmetric memory, for GPUs that reach each other's memory (NVLink, P2P): a
decode step's small all-reduces take torch's two-shot kernel (`torch.ops.symm_mem`, in place: the
same sums as NCCL, bit for bit, in less time) instead of NCCL's ring.

Each rank copies its tensor into a buffer every rank has mapped (row-parallel products write their
partial sums there directly: TensorParallel.reduce_buffer); the kernel meets its peers through flags
in that memory, so CUDA graphs capture it like any kernel. Where the product wrote into the buffer,
`all_reduce_add_rmsnorm` also does the add + RMSNorm after it (kernels/all_reduce_rmsnorm.py), at two
ranks: one-shot up to ONE_SHOT_BYTES (one barrier, no remote writes), two-shot above. Larger tensors,
other dtypes and GPUs without peer access stay with NCCL;
EngineConfig.symmetric_all_reduce = False turns it off. A rank killed mid-job still gives the
engine's one clear error (NCCL's abort cannot reach this kernel; tests/gpu/test_symmetric_all_reduce_gpu.py).
"""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist

from batchgen.kernels.all_reduce_rmsnorm import all_reduce_add_rmsnorm_one_shot_triton, all_reduce_add_rmsnorm_triton

log = logging.getLogger(__name__)

# torch's rendezvous (2.11 at least) numbers the store exchanges it makes with a counter per process:
# a process's second engine would meet fresh workers (counters at 0) with its counter further on, and
# every rank would wait for keys the others never write (it hung so). So only the first
# tensor-parallel engine of a process uses symmetric memory; later ones use NCCL.
_opened_in_this_process = False

# 64 MiB: a prefill step of 8,192 tokens of hidden 4096 (still faster than NCCL); NCCL above it. Twice
# this a rank (sums and normed rows). At two ranks only: more ranks keep the 2 MiB of decode steps and
# the norm's own kernel (the fused kernel is correct at four ranks, but slower end to end there).
MAX_BYTES = 64 << 20
MAX_BYTES_MORE_RANKS = 2 << 20
FUSED_NORM_RANKS = 2  # the world size the fused add + RMSNorm runs at
DTYPE = torch.bfloat16  # the dtype it was measured in
ELEMENT_MULTIPLE = 64  # numel a multiple of this: every rank's slice stays 16-byte aligned
# The fused norm's partial sums up to this size (a decode step's) take the one-shot kernel, which has no
# barrier after its reads: a product may rewrite its buffer while a peer still reads the last call's sums.
# So its calls alternate two buffers of their own; the next call's barrier proves the peers are past the
# last but one, and any all-reduce in between (every forward starts with the embedding's) proves they are
# past all before it, so the alternation starts again from the first there (graphs and eager calls agree).
ONE_SHOT_BYTES = 2 << 20


class SymmetricAllReduce:
    def __init__(self, group_name: str, allocation: torch.Tensor, bases: torch.Tensor, rank: int, max_programs: int):
        """allocation: this rank's symmetric memory (layout()): the sums' buffer, the fused norm's output
        rows, its int32 flags (zeroed), then the one-shot form's two buffers; bases: [W] int64, every
        rank's address of it."""
        self.group_name = group_name
        self.max_bytes = max_bytes(bases.numel())
        offsets = layout(self.max_bytes, max_programs, bases.numel())
        self.buffer = _view(allocation, offsets["sums"], self.max_bytes)  # every rank's: partial sums in, sums out
        self.normed = _view(allocation, offsets["normed"], self.max_bytes)  # all_reduce_add_rmsnorm's output
        self.one_shot = [_view(allocation, offsets[name], ONE_SHOT_BYTES) for name in ("one_shot_0", "one_shot_1")]
        self.bases, self.rank, self.max_programs = bases, rank, max_programs
        self.fuse_norm = bases.numel() == FUSED_NORM_RANKS
        self._offsets = offsets
        self._one_shot_offsets = (offsets["one_shot_0"], offsets["one_shot_1"])
        self._next_one_shot = 0  # the one-shot buffer the next call takes
        self._counters = torch.zeros(max_programs, dtype=torch.int32, device=allocation.device)  # epoch barrier's
        self._reduce_in_place = torch.ops.symm_mem.two_shot_all_reduce_

    def takes_partials(self, x: torch.Tensor) -> bool:
        """all_reduce_add_rmsnorm can take x: the fused kernel is on (two ranks) and x is
        staging()'s view, where a product wrote its partial sums."""
        staged = (self.buffer.data_ptr(), self.one_shot[self._next_one_shot].data_ptr())
        return self.fuse_norm and x.data_ptr() in staged

    def all_reduce_add_rmsnorm(self, partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """partials (held here) summed over ranks, + residual, RMSNorm: -> (normed, new residual). The
        normed rows are this object's output buffer (valid until the next call: the product after the
        norm reads them first); the residual is updated in place and right on this rank's rows at least
        (kernels/all_reduce_rmsnorm.py): only the next such call reads it, on the same rows. Partials
        here are bf16, so the model is, with its norms and residual (the launcher asserts the dtypes)."""
        assert residual.shape == partials.shape and residual.dtype == partials.dtype
        normed = self.normed[: partials.numel()].view(partials.shape)
        which = self._next_one_shot
        if partials.data_ptr() == self.one_shot[which].data_ptr():
            all_reduce_add_rmsnorm_one_shot_triton(self.bases, self.rank, residual, weight, eps, normed,
                                                   self._one_shot_offsets[which], self._offsets["epochs"],
                                                   self._counters)
            self._next_one_shot = 1 - which
        else:
            all_reduce_add_rmsnorm_triton(self.bases, self.rank, residual, weight, eps, self._offsets["normed"],
                                          self._offsets["flags"], self.max_programs)
            self._next_one_shot = 0  # (its barrier after the writes: the peers are past every earlier read)
        return normed, residual

    def fits(self, x: torch.Tensor) -> bool:
        """The same answer on every rank: ranks all-reduce tensors of the same shape and dtype."""
        return (x.dtype == DTYPE and x.numel() * x.element_size() <= self.max_bytes
                and x.numel() % ELEMENT_MULTIPLE == 0 and x.is_contiguous() and x.is_cuda)

    def staging(self, rows: int, cols: int, dtype: torch.dtype, for_norm: bool = False) -> torch.Tensor | None:
        """The buffer as [rows, cols], for a product to write the partial sums it will all-reduce
        (which saves __call__'s copy into it), or None where such a tensor does not fit. for_norm: the
        sums go to all_reduce_add_rmsnorm next, so small ones take the one-shot form's next buffer."""
        numel = rows * cols
        if dtype != DTYPE or numel * DTYPE.itemsize > self.max_bytes or numel % ELEMENT_MULTIPLE:
            return None
        if for_norm and self.fuse_norm and numel * DTYPE.itemsize <= ONE_SHOT_BYTES:
            return self.one_shot[self._next_one_shot][:numel].view(rows, cols)
        return self.buffer[:numel].view(rows, cols)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks: the buffer itself where x is the staging buffer (a product wrote it there:
        the sum is valid until the next product writes into it, and every consumer of a row-parallel
        product's sum runs before that), otherwise into x (which a caller may keep: the embedding's sum
        is the first layer's residual)."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        written_there = flat.data_ptr() == staged.data_ptr()
        if not written_there:
            staged.copy_(flat)
        self._reduce_in_place(staged, "sum", self.group_name)
        self._next_one_shot = 0  # (a barrier after: the peers are past every earlier read)
        if not written_there:
            flat.copy_(staged)
        return x

    def close(self) -> None:
        """Forget the group (its registry entry holds the NCCL backend) and the buffer."""
        self.buffer = None
        unregister = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)
        if unregister is not None:
            try:
                unregister(self.group_name)
            except Exception:  # best effort: the engine is closing
                pass


def max_bytes(size: int) -> int:
    """The largest all-reduce (bytes of bf16) that takes symmetric memory among `size` ranks."""
    return MAX_BYTES if size == FUSED_NORM_RANKS else MAX_BYTES_MORE_RANKS


def layout(sums_bytes: int, max_programs: int, size: int) -> dict[str, int]:
    """Byte offsets in each rank's allocation, 16-byte aligned, and its "end": the sums' buffer (at 0,
    where torch's all-reduce takes it), the fused norm's output rows, the two-shot barrier's int32 flags
    [2, max_programs, size] and the one-shot one's [max_programs, size], the one-shot form's two buffers."""
    sizes = {"sums": sums_bytes, "normed": sums_bytes, "flags": 2 * max_programs * size * 4,
             "epochs": max_programs * size * 4, "one_shot_0": ONE_SHOT_BYTES, "one_shot_1": ONE_SHOT_BYTES}
    offsets, at = {}, 0
    for name, size_bytes in sizes.items():
        offsets[name] = at
        at += -(-size_bytes // 16) * 16
    offsets["end"] = at
    return offsets


def _view(allocation: torch.Tensor, offset: int, size_bytes: int) -> torch.Tensor:
    """allocation's bytes [offset, offset + size_bytes) as its dtype."""
    start = offset // allocation.element_size()
    return allocation[start: start + size_bytes // allocation.element_size()]


def supported_here(rank: int, size: int, device: torch.device) -> bool:
    """This rank could take part: a CUDA device that reaches every other rank's GPU directly, and a
    torch that has the two-shot kernel and the process-group calls open_symmetric makes. Every rank
    must agree before the (collective) set-up."""
    if device.type != "cuda" or size < 2:
        return False
    if _opened_in_this_process:  # (a later engine: see _opened_in_this_process)
        log.info("tensor parallelism: NCCL all-reduces (symmetric memory serves only a process's first engine)")
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
            return False
    except (ImportError, AttributeError, RuntimeError):
        return False
    wrapping = ("_set_default_backend", "_register_backend", "_set_group_name")  # open_symmetric's calls
    if not all(hasattr(dist.ProcessGroup, f) for f in wrapping) or not hasattr(
            torch._C._distributed_c10d, "_register_process_group"):
        return False
    if torch.cuda.device_count() < size:  # each rank's GPU visible here, as the engine's workers have it
        return False
    return all(torch.cuda.can_device_access_peer(rank, peer) for peer in range(size) if peer != rank)


def open_symmetric(store, rank: int, size: int, device: torch.device, backend, store_path: str,
                   max_programs: int) -> SymmetricAllReduce:
    """Collective: every rank calls it once supported_here() held on all of them, with the same
    max_programs (at most one program an SM on every rank: the fused norm's grid must be co-resident).

    torch's symmetric memory finds its ranks through a registered process group, so the engine's
    NCCL backend is wrapped in one, under a name made from the engine's own rendezvous path (two
    engines in one process never share it)."""
    import torch.distributed._symmetric_memory as symm_mem

    global _opened_in_this_process
    _opened_in_this_process = True  # (set before the rendezvous: one that fails is not retried either)
    name = "batchgen-tp-" + hashlib.sha1(store_path.encode()).hexdigest()[:16]
    group = dist.ProcessGroup(dist.PrefixStore("symmetric", store), rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    group._register_backend(torch.device(device.type), dist.ProcessGroup.BackendType.NCCL, backend)
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)
    offsets = layout(max_bytes(size), max_programs, size)
    allocation = symm_mem.empty(offsets["end"] // DTYPE.itemsize, dtype=DTYPE, device=device)
    allocation[offsets["flags"] // DTYPE.itemsize: offsets["one_shot_0"] // DTYPE.itemsize].zero_()  # both flags
    torch.cuda.synchronize(device)  # (zero before any peer can signal: after the rendezvous)
    handle = symm_mem.rendezvous(allocation, name)
    shift = allocation.data_ptr() - handle.buffer_ptrs[rank]  # (the tensor may start inside its block)
    bases = torch.tensor([p + shift for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
    return SymmetricAllReduce(name, allocation, bases, rank, max_programs)
