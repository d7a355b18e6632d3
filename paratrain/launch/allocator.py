"""Host memory: keep what CPU tensors free inside the process, for the next step's tensors.

glibc's malloc maps each large block afresh and unmaps it when freed, and trims the heap's free top; a
training step allocates and frees the same megabytes of activations and gradients every step, so the kernel
maps, zero-fills and unmaps them every step. ``keep_freed_memory`` keeps them instead (``mallopt``: no trim,
``M_MMAP_MAX`` 0), the way PyTorch's caching allocator keeps GPU memory (benchmarks/results/step_options.md
measures it). The price: resident memory stays at its peak. A non-main thread's block larger than its
arena's 64 MiB heap still gets a mapping of its own. ``--no-keep-host-memory`` (or
``CpuTuning(keep_host_memory=False)``) leaves malloc as it is; with other C libraries (musl, macOS) this does
nothing.
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
