import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Distributed tests run Gloo on loopback with one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PARATRAIN_THREADS_PER_WORKER", "1")  # tests run side by side (pytest -n 2)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Tests run in two pytest-xdist workers: each takes its rendezvous ports from a range of its
# own, below the kernel's ephemeral ports (32768 and up), so that neither another test's
# run nor any process's outgoing connection takes a port between its pick and its bind.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_INDEX = int(_WORKER[2:]) if _WORKER[2:].isdigit() else 0
os.environ.setdefault("PARATRAIN_PORT_RANGE", f"{20000 + 3000 * _INDEX}-{22999 + 3000 * _INDEX}")


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``paratrain ARGS`` in a fresh interpreter; returns the finished process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "paratrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or REPO,
    )


@pytest.fixture
def cli():
    return run_cli


def as_formed(spans: list[list[int]], replicas: int) -> list[list[int]]:
    """A fault-tolerant run's participants per step (``[first, last, P]`` spans), read as if
    every replica was in the first quorum. A replica that the machine's load keeps from its
    heartbeat for longer than --replica-heartbeat-timeout while the group forms misses the
    first quorum and takes a peer's state at the next (the run is the same: every step takes
    the whole global batch); that is allowed for the first 2 steps, never later."""
    if len(spans) > 1 and spans[0][0] == 1 and spans[0][1] <= 2 and spans[0][2] < replicas == spans[1][2]:
        return [[1, spans[1][1], replicas], *spans[2:]]
    return spans
