"""The processor a benchmark ran on: its model and the instructions PyTorch's CPU kernels
use (AVX2, AVX512). Recorded with CPU timings, since a virtual machine of one kind runs on
different processors from day to day, and bfloat16's speed and oneDNN's kernels depend on
them."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """``"AMD EPYC (AVX2)"``: /proc/cpuinfo's model name and torch's CPU capability."""
    import torch

    model = next((line.partition(":")[2].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return f"{model or platform.processor() or 'cpu'} ({torch.backends.cpu.get_cpu_capability()})"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
