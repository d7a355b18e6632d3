"""Host memory: keep what CPU tensors free inside the process, for the next step's tensors.

glibc's malloc serves each block above its mmap threshold (128 KiB at first, rising with
use to at most 32 MiB) with a fresh mapping that it unmaps when the block is freed, and
gives the heap's free top back to the system above its trim threshold. A training step
allocates and frees the same activations and gradients every step, megabytes each: so the
kernel maps them, zero-fills them page by page on first touch, and unmaps them again, every
step. ``keep_freed_memory`` raises both thresholds (``mallopt``), the way PyTorch's caching
allocator keeps GPU memory: the tutorial CNN's channels-last CPU step takes 0.84x the
time on this machine, 77 ms against 91 (benchmarks/results/step_options.md). The price:
the process's resident memory stays at its peak instead of shrinking between steps.
``--no-keep-host-memory`` (or ``Trainer(keep_host_memory=False)``) leaves malloc as it
is; so do other C libraries (musl, macOS), where this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters (malloc.h) and the largest values glibc accepts for them.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD = 2**31 - 1  # an int: never give the heap's top back
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit): larger blocks still map

_kept = False


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed blocks for reuse; True where it did (glibc)."""
    global _kept
    if not _kept:
        try:
            mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        # glibc returns 1 where it took a value; musl's mallopt is a stub that returns 0.
        _kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _kept
