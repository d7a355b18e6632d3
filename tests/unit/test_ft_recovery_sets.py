"""benchmarks/ft_recovery.py: several kill intervals share their undisturbed runs, and each
interval gets a table of its own."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ft_recovery  # noqa: E402

SECONDS = {0: 100.0, 30: 104.0, 10: 125.0}  # a run's length by its interval between kills (0: none)


@pytest.fixture
def runs(monkeypatch):
    """Record every run the benchmark asks for, in order, instead of training for minutes."""
    asked = []

    def train(model, strategy, extra, folder, kill_every=0, kills=0, longer=1, cluster=None):
        asked.append((kill_every, kills, extra))
        steps = [(t / 10, t) for t in range(1, 1000)]
        losses = [(30.0 * k, "paratrain: worker 1 was lost (killed by SIGKILL) after step 3") for k in range(kills)]
        accuracy = 0.9 if kills else 0.95
        return {
            "steps": steps,
            "errors": losses,
            "metrics": {"test_accuracy": accuracy},
            "seconds": SECONDS[kill_every],
            "steal": 0.0,
        }

    monkeypatch.setattr(ft_recovery, "train", train)
    return asked


def test_one_undisturbed_run_serves_every_interval_in_alternating_order(runs):
    forward = ft_recovery.throughput_kept("mlp", "allreduce-ft", [(30, 9), (10, 27)])
    assert [(every, kills) for every, kills, _ in runs] == [(0, 0), (30, 9), (10, 27)]
    # every run the same command: room for the most kills of any interval
    assert {tuple(extra) for _, _, extra in runs} == {("--max-restarts", "27")}
    runs.clear()
    backward = ft_recovery.throughput_kept("mlp", "allreduce-ft", [(30, 9), (10, 27)], disturbed_first=True)
    assert [(every, kills) for every, kills, _ in runs] == [(10, 27), (30, 9), (0, 0)]
    for pairs in (forward, backward):
        assert [(p["every"], p["kills"]) for p in pairs] == [(30, 9), (10, 27)]
        assert [p["kept"] for p in pairs] == pytest.approx([100 / 104, 100 / 125])
        assert [p["undisturbed_seconds"] for p in pairs] == [100.0, 100.0]
        assert [p["losses_reported"] for p in pairs] == [9, 27]
        assert [p["test_accuracy"] for p in pairs] == [0.9, 0.9]


def test_each_interval_gets_its_table_the_longest_first(runs):
    pairs = ft_recovery.throughput_kept("mlp", "allreduce-ft", [(10, 27), (30, 9)])
    rows = [{"kind": "throughput", "model": "mlp", "strategy": "allreduce-ft", **p, "runs": [p]} for p in pairs]
    lines = ft_recovery.tables(rows, 1, 10, 27, length="3x the model's epochs")
    headers = [i for i, line in enumerate(lines) if line.startswith("# Throughput kept")]
    assert [lines[i] for i in headers] == [
        "# Throughput kept: a random replica process killed every 30 s, 9 times (runs of 3x the model's epochs)",
        "# Throughput kept: a random replica process killed every 10 s, 27 times (runs of 3x the model's epochs)",
    ]
    below_30, below_10 = lines[headers[0] + 4], lines[headers[1] + 4]
    assert below_30.startswith("| mlp | allreduce-ft | 1 | 100.0 | 104.0 | 96% | 9 |")
    assert below_10.startswith("| mlp | allreduce-ft | 1 | 100.0 | 125.0 | 80% | 27 |")
    # 999 steps in each run: steps per second over the undisturbed and the disturbed command
    assert below_30.endswith("| 9.99 / 9.61 |") and below_10.endswith("| 9.99 / 7.99 |")
    assert "share their undisturbed runs" in lines[-1]


def test_a_row_recorded_before_rows_carried_their_interval_takes_the_files(runs):
    (pair,) = ft_recovery.throughput_kept("mlp", "allreduce-ft", [(30, 9)])
    del pair["every"], pair["kills"]
    lines = ft_recovery.tables([{"kind": "throughput", "model": "mlp", "strategy": "allreduce-ft", **pair}], 1, 30, 9)
    assert sum(line.startswith("# Throughput kept") for line in lines) == 1
    assert "killed every 30 s, 9 times" in next(line for line in lines if line.startswith("# Throughput kept"))
    assert not any("share their undisturbed runs" in line for line in lines)


def test_each_set_records_its_processor_and_the_tables_name_them_with_the_sets_that_did_not(runs, monkeypatch):
    monkeypatch.setattr(ft_recovery, "cpu_name", lambda: "AMD EPYC (AVX2)")
    new = ft_recovery.throughput_kept("mlp", "allreduce-ft", [(30, 9)])
    (backward,) = ft_recovery.throughput_kept("mlp", "allreduce-ft", [(30, 9)], disturbed_first=True)
    assert [p["processor"] for p in new] == ["AMD EPYC (AVX2)"]
    assert (new[0]["disturbed_first"], backward["disturbed_first"]) == (False, True)
    old = {key: value for key, value in new[0].items() if key not in ("processor", "disturbed_first")}  # before
    row = {
        "kind": "throughput",
        "model": "mlp",
        "strategy": "allreduce-ft",
        **new[0],
        "runs": [new[0], backward, old, old],
    }
    lines = ft_recovery.tables([row], 1, 30, 9)
    said = next(line for line in lines if line.startswith("The sets' processors"))
    assert said.endswith(
        ": mlp allreduce-ft every 30 s: AMD EPYC (AVX2) 2, 2 not recorded, disturbed runs first in 1 of 2."
    )
    unrecorded = {key: value for key, value in row.items() if key != "runs"} | {"runs": [old]}
    assert not any(line.startswith("The sets' processors") for line in ft_recovery.tables([unrecorded], 1, 30, 9))
