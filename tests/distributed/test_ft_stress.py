"""Several kills in one fault-tolerant run, the first replica's and a replacement's among
them, at seeded random moments: the run ends, exits 0, and reaches the accuracy of the run
without a fault (paratrain/drills/replica_kills.py; benchmarks/ft_stress.py runs a hundred
kills a strategy, here three, in a run of replicas of one process, of two shards each, and
of DiLoCo's outer steps)."""

import random

import pytest

from paratrain.drills import SEED_VARIABLE, drill_seed
from paratrain.drills.replica_kills import STRATEGIES, stressed_run, undisturbed

pytestmark = pytest.mark.distributed

SEED = drill_seed()


# fsdp-ft's and diloco-ft's replacements: test_fault_tolerant_fsdp.py, test_fault_tolerant_averaging.py
@pytest.mark.parametrize(
    "strategy",
    [
        "allreduce-ft",
        pytest.param("fsdp-ft", marks=pytest.mark.matrix),
        pytest.param("diloco-ft", marks=pytest.mark.matrix),
    ],
)
def test_kills_of_the_first_replica_and_of_a_replacement_never_hang_and_cost_no_accuracy(strategy, request):
    matrix = "PARATRAIN_MATRIX=full " if request.node.get_closest_marker("matrix") else ""  # else deselected
    print(f"ft stress seed {SEED}: repeat with {matrix}{SEED_VARIABLE}={SEED} pytest '{request.node.nodeid}'")
    calm = undisturbed(strategy)
    rng = random.Random(f"{SEED}-{strategy}")
    row = stressed_run(strategy, calm, 3, rng)
    kinds = [(kill["kind"], kill.get("replica")) for kill in row["kills"]]
    assert row["ended"], f"hung after {kinds}\n{row['stderr_tail']}"
    # the harness killed the replica it meant to (the launcher named it), else its kills are not the drill's
    assert all(k.get("named") in (None, k.get("replica")) for k in row["kills"]), (row["kills"], row["stderr_tail"])
    assert row["exit"] == 0, f"{kinds}\n{row['stderr_tail']}"
    # the first replica goes first (no kill at all: the run ended before the first was due)
    assert kinds and kinds[0] == ("replica", 0), (
        f"{kinds}: kills due at {row['moments']}, the run's last step logged {row['last_step']} "
        f"(undisturbed: {calm['steps']})\n{row['stderr_tail']}"
    )
    # 1 point; 3 for DiLoCo, whose outer steps a loss changes (docs/fault_tolerance.md)
    tolerance = STRATEGIES[strategy][3]
    assert abs(row["test_accuracy"] - calm["test_accuracy"]) <= tolerance, (row["test_accuracy"], calm, kinds)
