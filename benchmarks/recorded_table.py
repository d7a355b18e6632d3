"""How a benchmark records its results: the JSON document in its small form and its Markdown
table beside it (the docs link that table; they hold no copy of it). Also the processor a run
was measured on, which CPU timings record."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

#: Significant digits a recorded float keeps (never fewer than its integer part): the runs
#: behind a record vary by far more than this, and results/ stays small.
DIGITS = 4


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to DIGITS significant digits, keys and order kept."""
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return value
        return round(value, max(0, DIGITS - 1 - math.floor(math.log10(abs(value)))))
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(item) for item in value]
    return value


def small_json(document: Any) -> str:
    """The recorded form of a results document: floats rounded, compact, one line per item of
    a list of rows and per key of a long object (the .md beside it is the one to read)."""
    return _laid_out(rounded(document), 0) + "\n"


def _laid_out(value: Any, depth: int) -> str:
    flat = json.dumps(value, default=str, separators=(",", ":"))
    if len(flat) <= 100:
        return flat
    pad = " " * depth
    if isinstance(value, dict):
        keys = [f"{pad} {json.dumps(key)}:{_laid_out(item, depth + 1)}" for key, item in value.items()]
        return "{\n" + ",\n".join(keys) + f"\n{pad}}}"
    if isinstance(value, list) and all(isinstance(item, dict | list) for item in value):
        rows = [f"{pad} {json.dumps(item, default=str, separators=(',', ':'))}" for item in value]
        return "[\n" + ",\n".join(rows) + f"\n{pad}]"
    return flat


def record(out: Path, document: Any, lines: list[str], heading=()) -> None:
    """``document`` to ``out`` (.json), ``lines`` to its .md (after ``heading``); the table printed."""
    out.with_suffix(".json").write_text(small_json(document))
    out.with_suffix(".md").write_text("\n".join([*heading, *lines]) + "\n")
    print("\n".join(lines))


def cpu_name() -> str:
    """``"AMD EPYC (AVX2)"``: /proc/cpuinfo's model name and torch's CPU capability. Recorded
    with CPU timings: a virtual machine of one kind runs on different processors from day to
    day, and bfloat16's speed and oneDNN's kernels depend on them."""
    import torch

    model = next((line.partition(":")[2].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return f"{model or platform.processor() or 'cpu'} ({torch.backends.cpu.get_cpu_capability()})"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
