"""A kill drill at a random moment: SIGKILL one process of a local ``paratrain train`` run (any
worker, shard, stage or the chief; the launcher itself too) at a moment drawn from launch to
exit, and check that the run ends within its ``--timeout`` in one of four ways: finishing,
going on without the process, restarting from its checkpoint, or failing with one
``paratrain:`` line that names who died; and that no process of the run is left (with the
launcher killed: none ``ORPHAN_GRACE_S`` after it).

Moments are drawn uniformly from 0 to 1.2x the run's undisturbed length, so group formation,
checkpoint writes (every 10 steps) and the end of the run are all hit; the same seed draws the
same moments and victims. ``tests/distributed/test_kill_anytime.py`` runs one drill a strategy,
``benchmarks/kill_anytime.py`` twenty.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paratrain.testing import alive, descendants, run_processes

TIMEOUT_S = 20
ORPHAN_GRACE_S = 10  # a process still importing when the launcher dies notices within this
RUN = [
    "--epochs",
    "3",
    "--no-progress",
    "--log-every",
    "0",
    "--checkpoint-every",
    "10",
    "--max-restarts",
    "1",
    "--timeout",
    str(TIMEOUT_S),
    "--heartbeat-timeout",
    "2",
]
STRATEGIES = {
    "single": ["--strategy", "single"],
    "allreduce": ["--strategy", "allreduce", "--workers", "2"],
    "ps-sync": ["--strategy", "ps-sync", "--workers", "2"],
    "ps-backup": ["--strategy", "ps-backup", "--workers", "2", "--backup-workers", "1"],
    "ps-async": ["--strategy", "ps-async", "--workers", "2"],
    "pipeline": ["--strategy", "pipeline", "--stages", "2"],
    "local-sgd": ["--strategy", "local-sgd", "--workers", "2", "--sync-every", "4"],
    "diloco": ["--strategy", "diloco", "--workers", "2", "--sync-every", "4"],
    "fsdp": ["--strategy", "fsdp", "--workers", "2"],
    # recovers from live peers: no checkpoints (--max-restarts: replacements)
    "allreduce-ft": ["--strategy", "allreduce-ft", "--workers", "2"],
    "pipeline-ft": ["--strategy", "pipeline-ft", "--stages", "2", "--workers", "4"],
    # batch 4 (537 steps) and H = 2: the replicas train for as long as allreduce-ft's do
    "local-sgd-ft": ["--strategy", "local-sgd-ft", "--workers", "2", "--sync-every", "2", "--batch-size", "4"],
    "diloco-ft": ["--strategy", "diloco-ft", "--workers", "2", "--sync-every", "2", "--batch-size", "4"],
    "fsdp-ft": ["--strategy", "fsdp-ft", "--workers", "4", "--shards-per-replica", "2", "--batch-size", "8"],
}


def start(flags: list[str], folder: Path) -> subprocess.Popen:
    """``paratrain train`` with ``flags`` and the drill's settings, its files in ``folder``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PARATRAIN_THREADS_PER_WORKER": "1"}
    live = any(flag.endswith("-ft") for flag in flags)  # recovers from live peers: no checkpoints
    checkpoints = [] if live else ["--checkpoint-dir", str(folder / "ckpt")]
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        *flags,
        *RUN,
        *checkpoints,
        "--metrics-out",
        str(folder / "m.json"),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def undisturbed(flags: list[str]) -> float:
    """The seconds a run of ``flags`` takes with no kill."""
    with tempfile.TemporaryDirectory() as tmp:
        began = time.monotonic()
        process = start(flags, Path(tmp))
        _, err = process.communicate(timeout=600)
        if process.returncode:
            raise SystemExit(f"{flags}: the undisturbed run failed:\n{err[-2000:]}")
        return time.monotonic() - began


def drill(flags: list[str], moment: float, rng: random.Random, limit: float) -> dict:
    """One run, one process killed at ``moment`` seconds: what happened."""
    with tempfile.TemporaryDirectory() as tmp:
        began = time.monotonic()
        process = start(flags, Path(tmp))
        victim = "nothing (the run had ended)"
        killed_at = moment
        while time.monotonic() - began < moment and process.poll() is None:
            time.sleep(0.01)
        if process.poll() is None:
            tree = run_processes(process.pid)
            targets = [process.pid, *tree]
            pid = rng.choice(targets)
            victim = "the launcher" if pid == process.pid else f"process {targets.index(pid)} of {len(tree)}"
            killed_at = time.monotonic() - began
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                victim += " (already gone)"
            tree_at_kill = tree
        else:
            tree_at_kill = []
        try:
            _, err = process.communicate(timeout=limit)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            for pid in [process.pid, *descendants(process.pid)]:
                os.kill(pid, signal.SIGKILL)
            _, err = process.communicate()
        ended = time.monotonic() - began
        time.sleep(1.0)  # the launcher's children get their parent-death signal
        left = [pid for pid in tree_at_kill if alive(pid)]
        metrics = json.loads((Path(tmp) / "m.json").read_text()) if (Path(tmp) / "m.json").exists() else None
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    code = process.returncode
    if hung:
        outcome, ok = "HUNG", False
    elif code == 0:
        outcome = (
            "went on without it"
            if metrics and (metrics.get("workers_lost") or _dropped(metrics))
            else "restarted"
            if metrics and metrics.get("restarts") and "fault_tolerance" not in metrics
            else "finished"
        )
        ok = True
    elif victim == "the launcher":
        # its processes die with it (at once, or as soon as a starting one checks)
        outcome, ok = "launcher killed", ended - killed_at < ORPHAN_GRACE_S
    else:
        outcome, ok = f"failed (exit {code})", last.startswith("paratrain:")
    ok = ok and not left
    row = {
        "moment": round(moment, 2),
        "victim": victim,
        "exit": code,
        "outcome": outcome,
        "seconds": round(ended, 1),
        "left": len(left),
        "last_line": last[:300],
        "ok": ok,
    }
    if not ok:  # what the run said before it ended, to find the cause
        row["stderr_tail"] = err[-4000:]
    return row


def _dropped(metrics: dict) -> bool:
    """The -ft strategies: some steps (synchronizations) committed with fewer replicas than
    the run's (a replica was lost, and maybe replaced live)."""
    participants = metrics.get("participants") or {}
    return bool(participants) and participants["min"] < metrics.get("replicas", metrics["workers"])


def run_drills(strategy: str, drills: int, seed: int, log=print, length: float | None = None) -> list[dict]:
    """``drills`` kills in ``strategy``'s runs; ``length``: the undisturbed run's seconds
    (measured when not given)."""
    flags = STRATEGIES[strategy]
    length = length or undisturbed(flags)
    rng = random.Random(f"{seed}-{strategy}")
    rows = []
    for index in range(drills):
        moment = rng.uniform(0, 1.2 * length)
        row = {
            "strategy": strategy,
            "seed": seed,
            "drill": index,
            **drill(flags, moment, rng, limit=length + TIMEOUT_S + 30),
        }
        log(
            f"{strategy:9} #{index:2} kill {row['victim']} at {row['moment']:5.2f} s: {row['outcome']} in "
            f"{row['seconds']} s{'' if row['ok'] else '  <-- NOT OK'}  {row['last_line'][:120]}"
        )
        rows.append(row)
    return rows
