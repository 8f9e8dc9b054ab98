"""Programmatic dependent launch (PDL; Hopper and later GPUs) for the engine's Triton kernels.

A kernel launched with PDL may be put on the SMs while the kernel before it in the stream is still
running, so its launch and start-up overlap that kernel's tail instead of following it. In a decode
step of one sequence, ~140 small kernels run back to back and each such gap is a few microseconds
(benchmarks/KERNELS.md). The rules that keep it correct, for every kernel that takes PDL:

- before `wait_for_prior_kernels(PDL)` (griddepcontrol.wait: the kernel before it has finished
  and its writes are visible) a kernel reads only data that the kernel before it does not write
  (weights; kernels/rope_decode_attention.py also the step's index arrays and the cached K/V of
  earlier steps: every kernel before that one has finished, by the next rule), and writes nothing;
- right after the wait it lets the next kernel start (griddepcontrol.launch_dependents), so at most
  the next kernel waits beside it, never a cascade of them. A kernel of several waves of programs
  (decode attention's split kernel) lets it start later, each program once it has read its keys
  (wait_only_for_prior_kernels, then let_next_kernel_start): the next kernel's programs, put on the
  SMs early, would hold room its later waves need.

Any kernel after the wait has finished: the one before it waited for its own predecessor, and so on.
Kernels launched without PDL (torch's, cuBLAS, NCCL) keep the stream's full order. CUDA graphs
capture the launches as programmatic edges. BATCHGEN_PDL=0 turns it off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as cuda_extra


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("BATCHGEN_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
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
    has it, {PDL: False} elsewhere (CPU interpreter, older GPUs, older Triton)."""
    if device.type == "cuda" and _supported(device.index if device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


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
