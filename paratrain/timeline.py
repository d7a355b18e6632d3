"""Timeline of a run: spans of every phase of every step, as a Chrome/Perfetto trace.

Strategies and the loop mark their phases with ``with span("forward"):``. Without ``--timeline`` the
recorder is a no-op (``span`` returns one shared null context), so an uninstrumented run pays a lookup and a
call per phase. With ``--timeline FILE.json`` every process records "X" events on its own track (``pid`` =
global rank) into ``FILE.json.parts/rank-N.json`` and the chief merges them into FILE.json. Timestamps are
wall-clock microseconds (a ``time.time_ns`` start plus a monotonic offset), so one machine's tracks line up
exactly, several machines' as well as their clocks. Threads: ``compute`` (tid 0), ``comm`` (tid 1, DDP's
bucket all-reduces), ``io`` (tid 2, ``--checkpoint-async``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

#: The span names: what each phase of a step is called on the timeline.
COMPUTE_SPANS = ("data", "forward", "backward", "optimizer", "evaluate", "checkpoint")
COMM_SPANS = ("allreduce", "pull", "push", "synchronize")  # pull: a worker waiting for the shards' reply

COMPUTE = 0  # thread ids within a rank's track
COMM = 1
IO = 2
TRACKS = {COMPUTE: "compute", COMM: "comm", IO: "io"}


class Recorder:
    """Spans of one process, in memory until ``write_part``."""

    def __init__(self, rank: int, name: str):
        self.rank, self.name = rank, name
        self.events: list[dict[str, Any]] = []
        # Wall-clock anchor plus a monotonic offset: precise, and comparable across processes.
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()
        self._lock = threading.Lock()  # comm-hook callbacks may finish on another thread

    def now_us(self) -> float:
        return (self._anchor_ns + time.perf_counter_ns()) / 1000.0

    def add(self, name: str, start_us: float, end_us: float, tid: int = COMPUTE, **args: Any) -> None:
        event = {
            "name": name,
            "ph": "X",
            "ts": start_us,
            "dur": max(end_us - start_us, 0.0),
            "pid": self.rank,
            "tid": tid,
            "cat": TRACKS[tid],
        }
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, tid: int = COMPUTE, **args: Any) -> Iterator[None]:
        start = self.now_us()
        try:
            yield
        finally:
            self.add(name, start, self.now_us(), tid, **args)

    def metadata(self) -> list[dict[str, Any]]:
        return [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank} ({self.name})"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
            *(
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                for tid, name in TRACKS.items()
            ),
        ]

    def write_part(self, path: str | os.PathLike) -> Path:
        """Write this process's events to ``parts_dir(path)/rank-N.json`` (atomically)."""
        folder = parts_dir(path)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"rank-{self.rank}.json"
        tmp = folder / f".rank-{self.rank}.json.tmp"
        with self._lock:
            events = self.metadata() + list(self.events)
        tmp.write_text(json.dumps(events))
        os.replace(tmp, target)
        return target


_NULL = contextlib.nullcontext()
_RECORDER: Recorder | None = None


def span(name: str, tid: int = COMPUTE, **args: Any) -> contextlib.AbstractContextManager:
    """``with span("forward"):`` records a span when a timeline is on, else does nothing."""
    recorder = _RECORDER
    if recorder is None:
        return _NULL
    return recorder.span(name, tid, **args)


def recorder() -> Recorder | None:
    """The active recorder, or None without ``--timeline``."""
    return _RECORDER


def start(rank: int, name: str) -> Recorder:
    global _RECORDER
    _RECORDER = Recorder(rank, name)
    return _RECORDER


def stop() -> Recorder | None:
    global _RECORDER
    recorder, _RECORDER = _RECORDER, None
    return recorder


def parts_dir(path: str | os.PathLike) -> Path:
    target = Path(path).expanduser()
    return target.parent / f"{target.name}.parts"


def merge(
    path: str | os.PathLike, num_ranks: int, timeout: float = 60.0, lost: Callable[[], Collection[int]] = set
) -> dict[str, Any]:
    """On the chief: wait (up to ``timeout`` s) for every rank's part but those of ranks its
    launcher has given up for good (``lost()``: a replica lost with no replacement writes
    none), merge them into ``path`` as one trace with time starting at 0, remove the parts;
    the trace."""
    folder = parts_dir(path)
    wanted = [folder / f"rank-{rank}.json" for rank in range(num_ranks)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = lost()
        if all(part.exists() or rank in gone for rank, part in enumerate(wanted)):
            break
        time.sleep(0.05)
    events: list[dict[str, Any]] = []
    missing = []
    for part in wanted:
        if part.exists():
            events += json.loads(part.read_text())
        else:
            missing.append(part.stem)
    spans = [e for e in events if e["ph"] == "X"]
    origin = min((e["ts"] for e in spans), default=0.0)
    for e in spans:
        e["ts"] = round(e["ts"] - origin, 3)
        e["dur"] = round(e["dur"], 3)
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_us": origin, "ranks": num_ranks, "missing_ranks": missing},
    }
    target = Path(path).expanduser()
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"  # one writer's own
    tmp.write_text(json.dumps(trace))
    os.replace(tmp, target)
    for part in wanted:
        part.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
    return trace
