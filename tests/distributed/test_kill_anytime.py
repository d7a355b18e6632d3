"""A process killed at a random moment, in every kind of run: it ends within --timeout,
finishing, going on, restarting or naming who died, and leaves no process behind
(paratrain/drills/random_kill.py; benchmarks/kill_anytime.py runs 20 a strategy, here one
each, at a seeded moment)."""

import pytest

from paratrain.drills import SEED_VARIABLE, drill_seed
from paratrain.drills.random_kill import run_drills

SEED = drill_seed()


# allreduce-ft: tests/distributed/test_ft_stress.py kills three of its processes in one run
# and checks the accuracy too; pipeline-ft's drill here covers the replacing launcher's death.
@pytest.mark.parametrize(
    "strategy",
    [
        "allreduce",
        "ps-sync",
        "pipeline",
        "pipeline-ft",
        "local-sgd-ft",
        *(pytest.param(name, marks=pytest.mark.matrix) for name in ("ps-backup", "fsdp", "diloco", "fsdp-ft")),
    ],
)
def test_a_kill_at_a_random_moment_never_hangs(strategy, request):
    matrix = "PARATRAIN_MATRIX=full " if request.node.get_closest_marker("matrix") else ""  # else deselected
    print(f"kill drill seed {SEED}: repeat with {matrix}{SEED_VARIABLE}={SEED} pytest '{request.node.nodeid}'")
    rows = run_drills(strategy, 1, SEED, length=8.0)
    assert rows[0]["ok"], f"{rows[0]}\n{rows[0].get('stderr_tail', '')}"
