"""A process killed at a random moment, in every kind of run: it ends within --timeout,
finishing, going on, restarting or naming who died, and leaves no process behind
(benchmarks/kill_anytime.py runs 20 a strategy; here one each, at a seeded moment)."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kill_anytime  # noqa: E402

SEED = random.SystemRandom().randrange(10**6)


# allreduce-ft: tests/distributed/test_ft_stress.py kills three of its processes in one run
# and checks the accuracy too; pipeline-ft's drill here covers the replacing launcher's death.
@pytest.mark.parametrize(
    "strategy",
    ["allreduce", "ps-backup", "ps-sync", "pipeline", "fsdp", "diloco", "pipeline-ft", "local-sgd-ft", "fsdp-ft"],
)
def test_a_kill_at_a_random_moment_never_hangs(strategy):
    print(
        f"kill drill seed {SEED}: repeat with python benchmarks/kill_anytime.py --seed {SEED} "
        f"--strategies {strategy} --drills 1 --length 8"
    )
    rows = kill_anytime.run_drills(strategy, 1, SEED, length=8.0)
    assert rows[0]["ok"], f"{rows[0]}\n{rows[0].get('stderr_tail', '')}"
