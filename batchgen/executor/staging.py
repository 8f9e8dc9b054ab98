"""Pinned host memory for the small arrays a step copies to and from the device.

Allocating pinned memory is slow, and a pinned block cannot be reused while a copy from it may still
be queued; the engine runs one step ahead of reading results, so consecutive steps alternate between
two halves: step N+2 reuses step N's half only after step N's results were read back, which means
its copies are done.
"""
from __future__ import annotations

import torch


class PinnedArena:
    """A bump allocator over two halves of pinned host memory, one per step parity."""

    def __init__(self, capacity: int, dtype: torch.dtype):
        self.halves = [torch.empty(capacity, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.half, self.offset = 0, 0

    def next_step(self) -> None:
        self.half ^= 1
        self.offset = 0

    def take(self, n: int) -> torch.Tensor:
        """n elements of this step's half. A half that is full is replaced by one twice its size
        (a step that writes a long cached prefix into many token-table rows): the old one goes back
        to torch's pinned allocator, which reuses it only once the copies queued from it are done."""
        half = self.halves[self.half]
        if self.offset + n > half.numel():
            self.halves[self.half] = torch.empty(max(2 * half.numel(), n), dtype=half.dtype, pin_memory=True)
            self.offset = 0
        view = self.halves[self.half][self.offset : self.offset + n]
        self.offset += n
        return view


class Staging:
    """Host <-> device copies of a step's index arrays and results: through pinned arenas on CUDA,
    plain tensors on CPU.

    On CUDA a decode graph's packed inputs and a step's results are copied on two side streams, so that
    neither copy sits between two steps' kernels on the step's stream: the next step's inputs land while
    this step's LM head and sampling run (once the graph that read the buffer before is done), and the
    results are copied back while the next step's graph runs."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.arenas = None
        if device.type == "cuda":
            self.arenas = {dt: PinnedArena(capacity, dt) for dt in (torch.int64, torch.int32, torch.float32)}
            self.copy_in, self.copy_out = torch.cuda.Stream(device), torch.cuda.Stream(device)
            # the last reader of the static buffer is done: one event, recorded again each step (a wait
            # takes the record before it, so the copy-in stream never waits on a later one; before the
            # first record a wait is a no-op)
            self._static_read = torch.cuda.Event()

    def next_step(self) -> None:
        if self.arenas:
            for arena in self.arenas.values():
                arena.next_step()

    def to_device(self, arrays: list, dtype: torch.dtype) -> list[torch.Tensor]:
        """Several host arrays (lists or CPU tensors) to the device in one copy."""
        sizes = [len(a) for a in arrays]
        parts = [a.to(dtype) if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=dtype) for a in arrays]
        if self.arenas is None:
            return list(torch.cat(parts).split(sizes))
        host = self.arenas[dtype].take(sum(sizes))
        torch.cat(parts, out=host)
        return list(host.to(self.device, non_blocking=True).split(sizes))

    def to_static(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """A host int64 array into the first values of a device buffer, in one copy (through pinned
        memory on CUDA, on the copy-in stream once the buffer's last reader, marked by `static_read`, is
        done; the current stream waits for the copy)."""
        n = values.numel()
        if self.arenas is None:
            out[:n].copy_(values)
            return
        values = self.arenas[torch.int64].take(n).copy_(values)
        self.copy_in.wait_event(self._static_read)
        with torch.cuda.stream(self.copy_in):
            out[:n].copy_(values, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_in)

    def static_read(self) -> None:
        """Mark the point of the current stream after which the static buffer may be written again
        (after the graph replay that read it)."""
        if self.arenas is not None:
            self._static_read.record()

    def to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Start copying device tensors back, on the copy-out stream once the current stream has
        produced them -> (their host copies, an event: read them only after it), or (the tensors
        themselves, None) on CPU."""
        if self.arenas is None:
            return tensors, None
        self.copy_out.wait_stream(torch.cuda.current_stream(self.device))
        hosts = []
        with torch.cuda.stream(self.copy_out):
            for tensor in tensors:
                tensor.record_stream(self.copy_out)  # (its memory is not reused before the copy ran)
                host = self.arenas[tensor.dtype].take(tensor.numel()).view(tensor.shape)
                hosts.append(host.copy_(tensor, non_blocking=True))
            event = torch.cuda.Event()
            event.record()
        return hosts, event
