"""Host memory: keep what CPU tensors free inside the process, for the next step's tensors.

glibc's malloc serves each block above its mmap threshold (128 KiB at first, rising with
use to at most 32 MiB) with a fresh mapping that it unmaps when the block is freed, and
gives the heap's free top back to the system above its trim threshold. A training step
allocates and frees the same activations and gradients every step, megabytes each: so the
kernel maps them, zero-fills them page by page on first touch, and unmaps them again, every
step. ``keep_freed_memory`` keeps them instead (``mallopt``), the way PyTorch's caching
allocator keeps GPU memory: the heap's top is never given back, and no block is mapped
apart (``M_MMAP_MAX`` 0), not even one above the 32 MiB that the mmap threshold cannot be
raised past: an LSTM's one 95 MB block a step over 200 time steps at batch 64, or a conv net's
activations at batch 256 (38 MB) would be mapped and faulted in again every step. The
tutorial CNN's channels-last CPU step takes 0.84x the time on this machine, 77 ms against
91 (benchmarks/results/step_options.md); the LSTM's and the large batches' figures are in
benchmarks/results/host_memory.md. The price: the process's resident memory stays at its
peak instead of shrinking between steps. (A thread other than the main one allocating a
block larger than its arena's 64 MiB heap still gets a mapping of its own.)
``--no-keep-host-memory`` (or ``CpuTuning(keep_host_memory=False)``) leaves malloc as it
is; so do other C libraries (musl, macOS), where this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # an int: never give the heap's top back
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
MMAP_MAX = 0  # no block mapped apart: those above the threshold come from the heap too

#: What keep_freed_memory sets, in order: (parameter, value).
KEPT = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_MAX, MMAP_MAX))

_kept = False


def set_malloc(settings: tuple[tuple[int, int], ...]) -> bool:
    """Set this process's ``mallopt`` parameters; True where the C library took every one
    (glibc returns 1 where it took a value; musl's mallopt is a stub that returns 0)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in settings)


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed blocks for reuse; True where it did (glibc)."""
    global _kept
    if not _kept:
        _kept = set_malloc(KEPT)
    return _kept
