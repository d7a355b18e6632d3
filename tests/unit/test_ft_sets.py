"""benchmarks/ft_sets.py: runs sized to minutes on the day's speed, and sets of runs that join
a row recorded before (--add) or replace it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ft_recovery  # noqa: E402
import ft_sets  # noqa: E402

SETTINGS = {"every": [30.0, 10.0], "kills": [9, 27], "longer": 3, "minutes": 5.0}


def test_a_run_is_sized_from_its_start_and_its_training_pace():
    # 8x the epochs: 3 s to start and evaluate, 32 s of training (4 s a unit): 5 minutes are
    # 297 s of training, 74 units (74.25 rounded)
    assert ft_sets.longer_for(5, 35.0, 32.0) == 74
    assert ft_sets.longer_for(0.01, 35.0, 32.0) == 1  # never below one pass over the epochs
    with pytest.raises(SystemExit, match="make no sense"):
        ft_sets.longer_for(5, 10.0, 12.0)


def test_sizing_times_one_probe_run_of_the_strategy(monkeypatch, capsys):
    asked = []

    def train(model, strategy, extra, folder, kill_every=0, kills=0, longer=1, cluster=None):
        asked.append((strategy, kills, longer))
        return {"seconds": 3.0 + 4.0 * longer, "metrics": {"wall_seconds": 4.0 * longer}}

    monkeypatch.setattr(ft_recovery, "train", train)
    assert ft_recovery.sized("cifar_cnn", "local-sgd-ft", 5, None) == 74
    assert asked == [("local-sgd-ft", 0, ft_sets.PROBE)]
    assert "--minutes 5: 74x the model's epochs (8x took 35.0 s, 32.0 s of it training)" in capsys.readouterr().out


def _pair(kept: float, undisturbed: float = 100.0) -> dict:
    return {
        "undisturbed_seconds": undisturbed,
        "disturbed_seconds": undisturbed / kept,
        "kept": kept,
        "losses_reported": 9,
        "test_accuracy": 0.99,
        "undisturbed_test_accuracy": 0.99,
        "every": 30.0,
        "kills": 9,
        "longer": 70,
    }


def _row(*kept: float) -> dict:
    return ft_sets.row_of("cifar_cnn", "local-sgd-ft", (30.0, 9), [_pair(k) for k in kept])


def test_a_row_is_the_medians_of_its_pairs_and_keeps_how_they_ran():
    row = _row(0.90, 1.00, 0.95)
    assert row["kept"] == pytest.approx(0.95) and row["disturbed_seconds"] == pytest.approx(100 / 0.95)
    assert (row["every"], row["kills"]) == (30.0, 9) and "longer" not in row and len(row["runs"]) == 3


def test_added_sets_join_the_recorded_row_and_its_medians_are_made_again():
    earlier = {**SETTINGS, "rows": [_row(0.90, 0.92, 0.99), {**_row(0.5), "strategy": "diloco-ft"}]}
    rows = ft_sets.merged([_row(0.96, 0.98)], earlier, SETTINGS, add=True)
    mine = next(r for r in rows if r["strategy"] == "local-sgd-ft")
    assert len(mine["runs"]) == 5 and mine["kept"] == pytest.approx(0.96)
    assert [r["strategy"] for r in rows] == ["diloco-ft", "local-sgd-ft"]  # the other row stays


def test_without_add_new_sets_replace_the_row():
    earlier = {**SETTINGS, "rows": [_row(0.90, 0.92, 0.99)]}
    (row,) = ft_sets.merged([_row(0.96, 0.98)], earlier, SETTINGS, add=False)
    assert len(row["runs"]) == 2


def test_a_record_of_other_settings_is_replaced_or_refused_with_add():
    earlier = {**SETTINGS, "minutes": None, "longer": 55, "rows": [_row(0.90)]}
    assert ft_sets.merged([_row(0.96)], earlier, SETTINGS, add=False) == [_row(0.96)]
    with pytest.raises(SystemExit, match="55x the model's epochs, these about 5 minutes undisturbed"):
        ft_sets.merged([_row(0.96)], earlier, SETTINGS, add=True)


def test_a_record_made_before_minutes_keeps_its_rows_beside_runs_of_the_same_length():
    earlier = {"every": 30.0, "kills": 9, "longer": 55, "rows": [{**_row(0.9), "strategy": "diloco-ft"}]}
    now = {"every": 30.0, "kills": 9, "longer": 55, "minutes": None}
    assert [r["strategy"] for r in ft_sets.merged([_row(0.96)], earlier, now, add=False)] == [
        "diloco-ft",
        "local-sgd-ft",
    ]


def test_the_tables_say_how_long_the_runs_were():
    lines = ft_recovery.tables([_row(0.96)], 1, 30.0, 9, length=ft_sets.length_words({"minutes": 5.0}))
    assert "killed every 30 s, 9 times (runs of about 5 minutes undisturbed)" in "\n".join(lines)


def test_recovery_rows_and_rows_without_an_interval_are_matched_too():
    recovery = {"kind": "recovery", "model": "mlp", "strategy": "allreduce-ft", "runs": [], "median": {}}
    old = {k: v for k, v in _row(0.9).items() if k not in ("every", "kills")}
    earlier = {"every": 30.0, "kills": 9, "longer": 55, "rows": [recovery, old]}
    now = {"every": 30.0, "kills": 9, "longer": 55, "minutes": None}
    rows = ft_sets.merged([_row(0.96), {**recovery, "median": {"x": 1}}], earlier, now, add=True)
    assert len(rows) == 2 and len(rows[0]["runs"]) == 2 and rows[1]["median"] == {"x": 1}
    multi = {**SETTINGS, "rows": [recovery]}
    assert ft_sets.merged([recovery], multi, SETTINGS, add=False) == [recovery]
