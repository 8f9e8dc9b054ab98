"""Keep freed memory for reuse on CPU (glibc).

By default glibc's malloc gives big freed blocks back to the kernel (munmap, or a trim of the heap's
top), so each step's activations land on fresh pages and pay a page fault per 4 KiB: on a 2-core VM
an RMSNorm over 1200 x 576 bf16 took 2.3 ms that way and 0.5 ms with freed memory kept. The usual
remedy is to preload jemalloc or tcmalloc; telling glibc to keep blocks up to MMAP_THRESHOLD in its
heap, and up to TRIM_THRESHOLD of free memory at the heap's top, does the same with no extra package.
The process then holds on to memory it freed (bounded by its peak use), as a long-running engine
would anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process (once); False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: mallopt means something else or nothing
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
