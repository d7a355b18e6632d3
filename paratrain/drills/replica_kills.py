"""Many kills in one run of a per-step fault-tolerant strategy, to find the races between a
loss, a replacement's join and the survivors' next step.

A run is a local ``paratrain train`` of the mlp on digits (3 replicas for ``allreduce-ft``,
``local-sgd-ft`` and ``diloco-ft``; 2 replicas of 2 stages or shards for ``pipeline-ft`` and
``fsdp-ft``). Its kills (SIGKILL) come at steps drawn uniformly over the undisturbed run's
steps (the second before the first step included) and go to each replica in turn (the first
one included; a replica's process at random); every third kill instead waits for the
replacement the previous kill brought and kills it 0-1.5 s after it started. A run is ok when
it exits 0 within its limit (its undisturbed length x 3 + 60 s) with a test accuracy within
its strategy's tolerance of the undisturbed run's (``STRATEGIES``). The same seed draws the
same kills. ``tests/distributed/test_ft_stress.py`` runs three kills a strategy,
``benchmarks/ft_stress.py`` a hundred; ``PARATRAIN_DRILL_LOGS=DIR`` keeps every run's lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from paratrain.testing import descendants, run_processes

#: Where ``python -m paratrain`` runs from: the checkout this package is in.
CHECKOUT = Path(__file__).resolve().parents[2]
RUN = ["--log-every", "1", "--progress", "--timeout", "20"]
STRATEGIES = {
    # paratrain train's flags, replicas, processes per replica, test accuracy within this of the undisturbed run's
    "allreduce-ft": ("--workers 3 --epochs 20", 3, 1, 0.01),
    "pipeline-ft": ("--stages 2 --workers 4 --epochs 8", 2, 2, 0.01),
    "fsdp-ft": ("--workers 4 --shards-per-replica 2 --epochs 8", 2, 2, 0.01),
    "local-sgd-ft": ("--workers 3 --sync-every 8 --epochs 20", 3, 1, 0.02),
    "diloco-ft": ("--workers 3 --sync-every 8 --epochs 20", 3, 1, 0.03),
}
STEP = re.compile(r"^step (\d+),")
LOST = re.compile(r"paratrain: (?:worker|\w+ \d+ of replica) (\d+) was lost .* after step (\d+); a replacement")
LOGS = os.environ.get("PARATRAIN_DRILL_LOGS")  # a folder: each run's lines go there


class Run:
    """One `paratrain train` and what it printed, each line with its arrival time."""

    def __init__(self, strategy: str, extra: list[str], folder: Path):
        flags = ["--strategy", strategy, *STRATEGIES[strategy][0].split()]
        command = [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            *flags,
            *RUN,
            "--metrics-out",
            str(folder / "m.json"),
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PARATRAIN_THREADS_PER_WORKER": "1"}
        self.folder = folder
        self.began = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=CHECKOUT
        )
        self.steps: list[tuple[float, int]] = []
        self.errors: list[tuple[float, str]] = []
        streams = ((self.process.stdout, True), (self.process.stderr, False))
        self._readers = [threading.Thread(target=self._read, args=args, daemon=True) for args in streams]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, stdout: bool) -> None:
        for line in stream:
            now = time.monotonic() - self.began
            match = STEP.match(line) if stdout else None
            if match:
                self.steps.append((now, int(match.group(1))))
            elif not stdout:
                self.errors.append((now, line.rstrip()))

    def now(self) -> float:
        return time.monotonic() - self.began

    def wait(self, limit: float) -> bool:
        """Whether the run ended within ``limit`` seconds of its start; if not, it is killed."""
        try:
            self.process.wait(timeout=max(limit - self.now(), 0.1))
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
            for pid in [self.process.pid, *descendants(self.process.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        return ended

    def metrics(self) -> dict:
        path = self.folder / "m.json"
        return json.loads(path.read_text()) if path.exists() else {}


class Replicas:
    """Which process is which replica: the run's processes, oldest first, are the replicas'
    in order; the processes that appear later are, in order, the replacements of the losses
    the launcher reported (a replica's processes are replaced together)."""

    def __init__(self, run: Run, num_replicas: int, per_replica: int):
        self.run = run
        self.per_replica = per_replica
        self.first = num_replicas * per_replica
        self.slot_of: dict[int, int] = {}
        self.replacements: dict[int, float] = {}  # a replacement's process: when it appeared
        self.losses = 0  # the launcher's loss lines read so far
        self.coming: list[int] = []  # the replica of each replacement process not yet seen, in order
        self.abandoned: dict[float, set[int]] = {}  # losses whose replacement was killed before it joined

    def refresh(self) -> dict[int, list[int]]:
        """``{replica: its live processes}``."""
        current = run_processes(self.run.process.pid)
        lost = [int(m.group(1)) for _, line in list(self.run.errors) if (m := LOST.search(line))]
        self.coming += [slot for slot in lost[self.losses :] for _ in range(self.per_replica)]
        self.losses = len(lost)
        for pid in [p for p in current if p not in self.slot_of]:
            if len(self.slot_of) < self.first and not lost:
                self.slot_of[pid] = len(self.slot_of) // self.per_replica
            elif self.coming:  # else: a replacement whose loss line is not read yet
                self.slot_of[pid] = self.coming.pop(0)
                self.replacements[pid] = time.monotonic()
        members: dict[int, list[int]] = {}
        for pid in current:
            if pid in self.slot_of:
                members.setdefault(self.slot_of[pid], []).append(pid)
        return members

    def all_joined(self) -> bool:
        """Whether every replica lost so far is back: its replacement said it joined the run
        (each process of it), or, lost before the first step, took part in the first ones."""
        lost = [(int(m.group(1)), int(m.group(2)), t) for t, line in self.run.errors if (m := LOST.search(line))]
        for slot, step, at in lost:
            joined = sum(
                f"worker {w} joined the run" in line
                for t, line in self.run.errors
                if t > at
                for w in self._workers(slot)
            )
            if joined >= self.per_replica or slot in self.abandoned.get(at, ()):
                continue
            if step == 0 and any(t > at + 2.0 for t, _ in self.run.steps):
                continue
            return False
        return True

    def _workers(self, slot: int) -> range:
        """The worker numbers of replica ``slot``'s processes."""
        return range(slot * self.per_replica, (slot + 1) * self.per_replica)

    def abandon(self, slot: int) -> None:
        """The replacement of ``slot`` is killed: it will never say it joined (the next one will)."""
        lost = [t for t, line in self.run.errors if (m := LOST.search(line)) and int(m.group(1)) == slot]
        if lost:
            self.abandoned.setdefault(lost[-1], set()).add(slot)

    def fresh(self, slot: int) -> list[int]:
        """Replica ``slot``'s live replacements that appeared within the last 1.5 s (not another's:
        that one may hold the only state the previous kill's replacement can take)."""
        now = time.monotonic()
        return [
            p
            for p, t in self.replacements.items()
            if self.slot_of[p] == slot and now - t < 1.5 and Path(f"/proc/{p}").exists()
        ]

    def kill(self, pid: int) -> int | None:
        """SIGKILL, then wait (up to 5 s) for the launcher to say the replica was lost, so that
        the next kill knows who is left; the replica the launcher named (None: not said)."""
        said = len(self._sigkill_losses())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and self.run.process.poll() is None:
            if len(lost := self._sigkill_losses()) > said:
                return int(lost[said].group(1))
            time.sleep(0.01)
        return None

    def _sigkill_losses(self) -> list[re.Match]:
        """The launcher's lines so far that say a replica was lost to a SIGKILL."""
        return [m for _, line in list(self.run.errors) if (m := LOST.search(line)) and "SIGKILL" in line]


def stressed_run(strategy: str, calm: dict, kills: int, rng: random.Random, fork_server: bool = False) -> dict:
    """One run with ``kills`` kills (or one of the fork server) at steps drawn from 0 to the
    undisturbed run's last (by the run's progress, which the machine's load does not move;
    step 0: by the clock, in the second before the first step or at it); what happened."""
    _, num_replicas, per_replica, _ = STRATEGIES[strategy]
    steps = sorted(rng.randint(0, calm["steps"]) for _ in range(kills))
    moments = [(step, rng.uniform(max(calm["first_step"] - 1.0, 0.0), calm["first_step"])) for step in steps]
    limit = 3 * calm["seconds"] + 60
    with tempfile.TemporaryDirectory(prefix="ft-stress-") as tmp:
        # A kill can take a second process with it (a replacement whose state source was
        # killed exits, and is replaced in turn): restarts enough for both.
        run = Run(strategy, ["--max-restarts", str(2 * kills + 2)], Path(tmp))
        replicas = Replicas(run, num_replicas, per_replica)
        done: list[dict] = []
        for index, moment in enumerate(moments):
            kind = "fork server" if fork_server else ("replacement" if index % 3 == 2 and done else "replica")
            previous = done[-1].get("replica") if done else None
            victim = _victim(run, replicas, kind, moment, index, num_replicas, rng, limit, previous)
            if victim is None:
                break
            done.append(victim)
        ended, metrics = run.wait(limit), run.metrics()
    if LOGS:  # every line of the run, with its time and the kills', for a run to look into
        lines = [(t, f"{t:8.2f} {line}") for t, line in run.errors] + [(t, f"{t:8.2f} step {n}") for t, n in run.steps]
        lines += [(k["at"], f"{k['at']:8.2f} ## SIGKILL {k}") for k in done]
        path = Path(LOGS) / f"{strategy}-{int(time.time() * 1000)}.log"
        path.write_text("\n".join(line for _, line in sorted(lines)) + "\n")
    for kill in done:  # the survivors' pause: to the next step logged after the kill
        kill["pause"] = next((t - kill["at"] for t, _ in run.steps if t > kill["at"]), None)
    return {
        "strategy": strategy,
        "kills": done,
        "moments": moments,  # (step, seconds) each kill was due at, as drawn
        "last_step": last_step(run),  # the last step the run logged
        "ended": ended,
        "exit": run.process.returncode,
        "seconds": run.now(),
        "test_accuracy": metrics.get("test_accuracy"),
        "recoveries": sum("joined the run" in line for _, line in run.errors),
        "last_line": next((line for _, line in reversed(run.errors) if line.startswith("paratrain:")), ""),
        "stderr_tail": "\n".join(line for _, line in run.errors[-15:]),
    }


def _victim(
    run: Run,
    replicas: Replicas,
    kind: str,
    moment: tuple[int, float],
    index: int,
    num: int,
    rng: random.Random,
    limit: float,
    previous: int | None,
) -> dict | None:
    """Wait for the kill's moment (a replacement: for the one of the ``previous`` kill's replica
    to start) and kill; None once the run ended."""
    step, seconds = moment

    def due() -> bool:
        # step 0: by the clock, or at the first step where this run starts faster than the undisturbed one
        return last_step(run) >= step if step else run.now() >= seconds or last_step(run) > 0

    while run.process.poll() is None and run.now() < limit:
        members = replicas.refresh()
        if kind == "fork server":
            if due() and members:
                # The launcher's child (the replicas, forked from it, share its command line).
                helpers = set(descendants(run.process.pid)) - set(run_processes(run.process.pid))
                server = next((p for p in helpers if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()), None)
                if server is not None:
                    os.kill(server, signal.SIGKILL)
                    return {"kind": kind, "at": run.now(), "step": last_step(run)}
        elif kind == "replacement":
            fresh = replicas.fresh(previous)
            if fresh:
                pid = fresh[-1]
                time.sleep(rng.uniform(0.0, 1.5))
                replicas.abandon(replicas.slot_of[pid])
                at, logged = run.now(), last_step(run)
                named = replicas.kill(pid)
                return {"kind": kind, "replica": replicas.slot_of[pid], "named": named, "at": at, "step": logged}
        elif due():
            # Only while every other replica holds the run's state: a replica killed while the
            # last replacement still takes the state from it leaves no one to take it from.
            # And not before every replica's processes started (a run slower than the undisturbed
            # one can be due at step 0 before that): a replacement is told apart by coming later.
            slot = index % num
            if slot in members and len(replicas.slot_of) >= replicas.first and replicas.all_joined():
                pid = rng.choice(members[slot])
                at, logged = run.now(), last_step(run)
                named = replicas.kill(pid)
                return {"kind": kind, "replica": slot, "named": named, "at": at, "step": logged}
        time.sleep(0.02)
    return None


def last_step(run: Run) -> int:
    """The last step the run logged (0 before its first)."""
    return run.steps[-1][1] if run.steps else 0


def undisturbed(strategy: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ft-stress-") as tmp:
        run = Run(strategy, [], Path(tmp))
        if not run.wait(600) or run.process.returncode:
            raise SystemExit(f"the undisturbed {strategy} run failed:\n{run.errors[-20:]}")
        return {
            "seconds": run.now(),
            "first_step": run.steps[0][0],
            "last_step": run.steps[-1][0],
            "steps": run.steps[-1][1],
            "test_accuracy": run.metrics()["test_accuracy"],
        }


def verdict(row: dict, accuracy: float) -> bool:
    """A run is ok: it ended in time, exit 0, within its strategy's tolerance of the undisturbed
    accuracy; a fork-server kill: it ended in time with a line naming a loss."""
    if any(k["kind"] == "fork server" for k in row["kills"]):
        return row["ended"] and (row["exit"] == 0 or "lost" in row["last_line"] or "failed" in row["last_line"])
    tested = row["test_accuracy"] is not None and abs(row["test_accuracy"] - accuracy) <= STRATEGIES[row["strategy"]][3]
    return row["ended"] and row["exit"] == 0 and tested
