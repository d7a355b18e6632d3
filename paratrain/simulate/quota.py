"""A node limited to a share of one core by a CPU quota: cgroup CPU bandwidth control, as Kubernetes enforces
a pod's CPU limit and ``paratrain cluster run --cpu`` makes its hosts.

The kernel gives a node ``share x period`` CPU-seconds each period: its processes run at full speed until
that is spent, then wait for the next period; unused quota does not carry over. So a step's duration is not
its work over the share, and every message that needs the receiver's CPU waits whenever the receiver is
throttled, which slows a synchronous step with more nodes even over idle links. Each node's periods start
at a phase of its own, drawn once per run. ``ThrottledCore`` is one node's CPU for host.py's event loop;
``ThrottledNodes`` does the same arithmetic for many nodes at once as arrays, so that a simulation of
hundreds of nodes is not spent in a Python loop over hops.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

NO_PERIOD = np.iinfo(np.int64).min
"""``ThrottledNodes``' period index for a node that has counted none yet (a core's None)."""


class ThrottledCore:
    """One node's CPU: ``share`` of a core as a quota of ``share * period`` seconds per period,
    periods starting at ``phase`` (seconds, in [0, period))."""

    def __init__(self, share: float, period: float, phase: float = 0.0):
        if not 0 < share <= 1:
            raise ValueError(f"a CPU share must be in (0, 1], got {share}")
        self.share = share
        self.period = period
        self.phase = phase
        self.quota = share * period
        self._index: int | None = None  # the period whose quota `_used` counts
        self._used = 0.0
        self.jobs: deque[tuple[float, Callable[..., None], tuple]] = deque()  # (work, done, args)
        self._end = math.inf  # when the running job (the first) ends
        self.on_end: Callable[[ThrottledCore], None] | None = None
        """Called whenever the running job's end is set (an event loop's index of ends)."""

    def run(self, t: float, work: float) -> float:
        """Do ``work`` CPU-seconds from ``t`` on (nothing else running here): when it ends."""
        index = math.floor((t - self.phase) / self.period)
        while True:
            if index != self._index:
                self._index, self._used = index, 0.0
            period_end = self.phase + (index + 1) * self.period
            span = min(self.quota - self._used, period_end - t)
            if span > 0 and work <= span:
                self._used += work
                return t + work
            if span > 0:
                work -= span
                self._used += span
            index += 1  # the quota is spent (throttled), or the period is over
            t = max(t, period_end)

    # ----- host.py's core interface (as SharedCores) --------------------------------------------
    def start(self, t: float, work: float, done: Callable[..., None], *args: Any) -> None:
        """Queue a job of ``work`` CPU-seconds at ``t``; ``done(end, *args)`` when it is through."""
        self.jobs.append((work, done, args))
        if len(self.jobs) == 1:
            self._set_end(self.run(t, work))

    def next_end(self) -> float:
        return self._end if self.jobs else math.inf

    def advance(self, t: float) -> None:
        """Nothing to do: a job's end is known when it starts."""

    def pop(self, t: float) -> tuple[Callable[..., None], tuple]:
        _, done, args = self.jobs.popleft()
        if self.jobs:
            self._set_end(self.run(t, self.jobs[0][0]))
        return done, args

    def _set_end(self, end: float) -> None:
        self._end = end
        if self.on_end is not None:
            self.on_end(self)


class ThrottledNodes:
    """``ThrottledCore.run`` on many nodes at once: their quota states taken into arrays,
    worked on, and given back (``close``); nothing else may run on them in between."""

    def __init__(self, cores: Sequence[ThrottledCore]):
        self.cores = cores
        self.phase = np.array([c.phase for c in cores])
        self.period = np.array([c.period for c in cores])
        self.quota = np.array([c.quota for c in cores])
        self.index = np.array([NO_PERIOD if c._index is None else c._index for c in cores])
        self.used = np.array([c._used for c in cores])

    def run(self, t: np.ndarray, work: float) -> np.ndarray:
        """Node i does ``work`` CPU-seconds from ``t[i]`` on: when each ends."""
        t, work_left = np.array(t, dtype=float), np.full(len(self.cores), float(work))
        end = np.empty_like(t)
        index = np.floor((t - self.phase) / self.period).astype(np.int64)
        active = np.ones(len(t), dtype=bool)
        while True:  # whole-array steps (cheaper than masked ones at these sizes); most end in one
            fresh = active & (index != self.index)
            self.index = np.where(fresh, index, self.index)
            self.used = np.where(fresh, 0.0, self.used)
            period_end = self.phase + (index + 1) * self.period
            span = np.minimum(self.quota - self.used, period_end - t)
            room = active & (span > 0)
            finished = room & (work_left <= span)
            np.copyto(end, t + work_left, where=finished)
            took = np.where(finished, work_left, np.where(room, span, 0.0))
            self.used = self.used + took
            active &= ~finished  # the rest: quota spent (throttled) or period over, on to the next
            if not active.any():
                return end
            work_left = work_left - np.where(active, took, 0.0)
            index = np.where(active, index + 1, index)
            t = np.where(active, np.maximum(t, period_end), t)

    def close(self) -> None:
        """Give the states back to the cores."""
        for core, index, used in zip(self.cores, self.index.tolist(), self.used.tolist(), strict=True):
            core._index, core._used = (None if index == NO_PERIOD else index), used


def ring_on_nodes(
    nodes: ThrottledNodes, done: np.ndarray, transfer: float, hop_s: float, wire: float = 0.0
) -> np.ndarray:
    """A ring all-reduce across ``nodes`` from ``done`` (when each has its input): 2(N-1) steps,
    in each of which every node sends a slice to the next (``transfer`` s before its bytes
    start to arrive, then ``wire`` s while they do) and works ``hop_s`` CPU-seconds on the
    slice it receives, when its quota lets it. The receiver's work starts as the bytes start
    to arrive and overlaps their wire time (the transport reads a slice as it comes), so a
    step ends when both its work and its last byte are done: on a slow link the wire, on a
    fast one the CPU, bounds it. When each node has the result."""
    for _ in range(2 * (len(done) - 1)):
        sent = np.roll(done, 1) + transfer
        done = np.maximum(nodes.run(np.maximum(sent, done), hop_s), sent + wire)
    return done
