"""What each loss of a replica cost a run, and how long its survivors stood still, read from
the run's own step log (benchmarks/ft_recovery.py's "a loss costs" and "longest pause" columns)."""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Callable

#: A launcher's line that says a replica (or, restarting, the run) was lost.
LOSS = re.compile(r"was lost|restarting the run|paratrain cluster: replica")


def loss_costs(steps: list[tuple[float, int]], losses: list[float], window: float = 10.0) -> list[float]:
    """What each loss cost the run, in seconds, from its own step log (so not from two runs'
    difference, which this machine's drift between runs blurs by several percent): the time
    from the loss over the next ``window`` s (less where the next loss or the run's end comes
    sooner), less the time the steps made meanwhile take at the run's pace of the 5 s before
    the loss (after the previous loss's first ``window / 2`` s). A restart's redone steps count
    as lost: progress is the highest step reached."""
    costs = []
    at = _progress(steps)
    for k, lost in enumerate(losses):
        end = min([lost + window, steps[-1][0], *(t - 0.3 for t in losses[k + 1 :])])
        start = max(lost - 5.0, steps[0][0], *(t + window / 2 for t in losses[:k]))
        if end - lost < 2.0 or lost - 0.3 - start < 2.0:  # too close to another loss or the run's ends
            continue
        pace = (at(lost - 0.3) - at(start)) / (lost - 0.3 - start)
        if pace > 0:
            costs.append((end - lost) - (at(end) - at(lost)) / pace)
    return costs


def longest_pause(after: list[tuple[float, int]], killed: float, until: float) -> float:
    """The longest time the run logged no step from the kill on, up to its first step
    ``until`` seconds after the kill (the replacement's first, or the restart's past the
    kill): a survivor of a periodic strategy steps on alone at once and waits at the next
    synchronization, and one under per-step quorums may wait again as the replacement
    takes the live state, which the first step after the kill does not show."""
    times = [killed, *(t for t, _ in after if t - killed <= until + 1e-9)]
    return max(b - a for a, b in zip(times, times[1:]))


def pace(steps: list[tuple[float, int]], width: float = 10.0) -> list[float]:
    """The run's steps per second in each ``width`` s from its start (progress: the highest
    step reached), to see where in a run its time went: around each loss, or spread over it."""
    if not steps:
        return []
    at = _progress(steps)
    return [(at((k + 1) * width) - at(k * width)) / width for k in range(math.ceil(steps[-1][0] / width))]


def _progress(steps: list[tuple[float, int]]) -> Callable[[float], int]:
    """The highest step a run's log (``(seconds, step)`` lines) had reached by a time: a
    restart's redone steps are not progress."""
    times = [t for t, _ in steps]
    reached = list(itertools.accumulate((s for _, s in steps), max))

    def at(t: float) -> int:
        index = bisect.bisect_right(times, t)
        return reached[index - 1] if index else 0

    return at
