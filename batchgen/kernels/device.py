"""What the launchers ask of the GPU: its index, its SM count, the Triton interpreter, and
programmatic dependent launch (PDL, Hopper and later).

PDL lets a kernel be put on the SMs while the kernel before it in the stream still runs, so its
launch and start-up overlap that kernel's tail. The rules that keep it correct, for every kernel
that takes PDL:

- before `wait_for_prior_kernels(PDL)` (griddepcontrol.wait: the kernel before it has finished and
  its writes are visible) a kernel reads only data that the kernel before it does not write
  (weights; kernels/rope_decode_attention.py also the step's index arrays and the cached K/V of
  earlier steps: every kernel before that one has finished, by the next rule), and writes nothing;
- right after the wait it lets the next kernel start (griddepcontrol.launch_dependents), so at most
  the next kernel waits beside it, never a cascade of them. A kernel of several waves of programs
  (decode attention's split kernel) lets it start later, each program once it has read its keys
  (wait_only_for_prior_kernels, then let_next_kernel_start): the next kernel's programs, put on the
  SMs early, would hold room its later waves need.

Any kernel after the wait has finished: the one before it waited for its own predecessor, and so on.
Kernels launched without PDL (torch's, cuBLAS, NCCL) keep the stream's full order. CUDA graphs
capture the launches as programmatic edges. EngineConfig.pdl = False turns it off (`use_pdl`).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as cuda_extra

_NUM_SMS: dict[int, int] = {}
_pdl_wanted = True  # EngineConfig.pdl, set by the model's builder (use_pdl)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1: the kernel tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_index(device: torch.device) -> int:
    """A CUDA device's index ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    index = device_index(device)
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def use_pdl(enabled: bool) -> None:
    """Whether kernels launched from now on take PDL where the GPU has it (EngineConfig.pdl; set when
    the model is built, before any kernel is compiled or captured)."""
    global _pdl_wanted
    _pdl_wanted = enabled


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if interpreting():
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9 or not hasattr(cuda_extra, "gdc_wait"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_launch_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes PDL: {PDL, launch_pdl} on a GPU that
    has it, {PDL: False} elsewhere (CPU interpreter, older GPUs, older Triton, use_pdl(False))."""
    if _pdl_wanted and device.type == "cuda" and _pdl_supported(device_index(device)):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def exact_dot(a, b):
    """a [M, K] @ b [K, N] in fp32, each output element summed on its own: what the kernels use under
    the interpreter where a row's bits must not depend on the tile's other rows (batch-invariant mode),
    which numpy's matmul, behind the interpreter's tl.dot, does not promise."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def wait_for_prior_kernels(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the next one start (see the module's rules)."""
    wait_only_for_prior_kernels(PDL)
    let_next_kernel_start(PDL)


@triton.jit
def wait_only_for_prior_kernels(PDL: tl.constexpr):
    """The wait alone: a kernel of several waves calls let_next_kernel_start later (the module's rules)."""
    if PDL:
        cuda_extra.gdc_wait()


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    """This program's part of letting the next kernel start (it starts once every program has called
    this or exited)."""
    if PDL:
        cuda_extra.gdc_launch_dependents()
