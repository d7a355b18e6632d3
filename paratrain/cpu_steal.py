"""The share of a machine's CPU time a hypervisor gave to other machines (steal: this virtual
machine's CPUs were ready to run and were not run). A cloud VM's neighbours move its speed;
a measurement that records what was stolen while it ran can be read against it (a
calibration's ``measured.steal``, the benchmarks' runs)."""

from __future__ import annotations


def cpu_times() -> list[int] | None:
    """This machine's CPU time so far in clock ticks, by kind (/proc/stat's first line: user,
    nice, system, idle, iowait, irq, softirq, steal); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as handle:
            return [int(value) for value in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def stolen_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Of the CPU time between two ``cpu_times``, the share a hypervisor gave to other
    machines (steal: this virtual machine's CPUs were ready to run and were not run)."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    spent = [b - a for a, b in zip(before, after)]
    return spent[7] / sum(spent) if sum(spent) > 0 else None
