"""benchmarks/ft_recovery.py's bookkeeping: several kill intervals share their undisturbed
runs and each gets a table; runs sized to minutes on the day's speed; sets of runs that join a
row recorded before (--add) or replace it; the cost of a loss read from a run's own step log."""

import ft_recovery
import pytest

# --- intervals between kills: shared undisturbed runs, a table each

SECONDS = {0: 100.0, 30: 104.0, 10: 125.0}  # a run's length by its interval between kills (0: none)
#: a record's settings (--every, --kills, --longer, --minutes)
RECORD_SETTINGS = {"every": [30.0, 10.0], "kills": [9, 27], "longer": 3, "minutes": 5.0}
PACE = 100  # steps a second


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


# --- sizing and sets of runs


def test_a_run_is_sized_from_its_start_and_its_training_pace():
    # 8x the epochs: 3 s to start and evaluate, 32 s of training (4 s a unit): 5 minutes are
    # 297 s of training, 74 units (74.25 rounded)
    assert ft_recovery.longer_for(5, 35.0, 32.0) == 74
    assert ft_recovery.longer_for(0.01, 35.0, 32.0) == 1  # never below one pass over the epochs
    with pytest.raises(SystemExit, match="make no sense"):
        ft_recovery.longer_for(5, 10.0, 12.0)


def test_sizing_times_one_probe_run_of_the_strategy(monkeypatch, capsys):
    asked = []

    def train(model, strategy, extra, folder, kill_every=0, kills=0, longer=1, cluster=None):
        asked.append((strategy, kills, longer))
        return {"seconds": 3.0 + 4.0 * longer, "metrics": {"wall_seconds": 4.0 * longer}}

    monkeypatch.setattr(ft_recovery, "train", train)
    assert ft_recovery.sized("cifar_cnn", "local-sgd-ft", 5, None) == 74
    assert asked == [("local-sgd-ft", 0, ft_recovery.PROBE)]
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
    return ft_recovery.row_of("cifar_cnn", "local-sgd-ft", (30.0, 9), [_pair(k) for k in kept])


def test_a_row_is_the_medians_of_its_pairs_and_keeps_how_they_ran():
    row = _row(0.90, 1.00, 0.95)
    assert row["kept"] == pytest.approx(0.95) and row["disturbed_seconds"] == pytest.approx(100 / 0.95)
    assert (row["every"], row["kills"]) == (30.0, 9) and "longer" not in row and len(row["runs"]) == 3


def test_added_sets_join_the_recorded_row_and_its_medians_are_made_again():
    earlier = {**RECORD_SETTINGS, "rows": [_row(0.90, 0.92, 0.99), {**_row(0.5), "strategy": "diloco-ft"}]}
    rows = ft_recovery.merged([_row(0.96, 0.98)], earlier, RECORD_SETTINGS, add=True)
    mine = next(r for r in rows if r["strategy"] == "local-sgd-ft")
    assert len(mine["runs"]) == 5 and mine["kept"] == pytest.approx(0.96)
    assert [r["strategy"] for r in rows] == ["diloco-ft", "local-sgd-ft"]  # the other row stays


def test_without_add_new_sets_replace_the_row():
    earlier = {**RECORD_SETTINGS, "rows": [_row(0.90, 0.92, 0.99)]}
    (row,) = ft_recovery.merged([_row(0.96, 0.98)], earlier, RECORD_SETTINGS, add=False)
    assert len(row["runs"]) == 2


def test_a_record_of_other_settings_is_replaced_or_refused_with_add():
    earlier = {**RECORD_SETTINGS, "minutes": None, "longer": 55, "rows": [_row(0.90)]}
    assert ft_recovery.merged([_row(0.96)], earlier, RECORD_SETTINGS, add=False) == [_row(0.96)]
    with pytest.raises(SystemExit, match="55x the model's epochs, these about 5 minutes undisturbed"):
        ft_recovery.merged([_row(0.96)], earlier, RECORD_SETTINGS, add=True)


def test_a_record_made_before_minutes_keeps_its_rows_beside_runs_of_the_same_length():
    earlier = {"every": 30.0, "kills": 9, "longer": 55, "rows": [{**_row(0.9), "strategy": "diloco-ft"}]}
    now = {"every": 30.0, "kills": 9, "longer": 55, "minutes": None}
    assert [r["strategy"] for r in ft_recovery.merged([_row(0.96)], earlier, now, add=False)] == [
        "diloco-ft",
        "local-sgd-ft",
    ]


def test_the_tables_say_how_long_the_runs_were():
    lines = ft_recovery.tables([_row(0.96)], 1, 30.0, 9, length=ft_recovery.length_words({"minutes": 5.0}))
    assert "killed every 30 s, 9 times (runs of about 5 minutes undisturbed)" in "\n".join(lines)


def test_recovery_rows_and_rows_without_an_interval_are_matched_too():
    recovery = {"kind": "recovery", "model": "mlp", "strategy": "allreduce-ft", "runs": [], "median": {}}
    old = {k: v for k, v in _row(0.9).items() if k not in ("every", "kills")}
    earlier = {"every": 30.0, "kills": 9, "longer": 55, "rows": [recovery, old]}
    now = {"every": 30.0, "kills": 9, "longer": 55, "minutes": None}
    rows = ft_recovery.merged([_row(0.96), {**recovery, "median": {"x": 1}}], earlier, now, add=True)
    assert len(rows) == 2 and len(rows[0]["runs"]) == 2 and rows[1]["median"] == {"x": 1}
    multi = {**RECORD_SETTINGS, "rows": [recovery]}
    assert ft_recovery.merged([recovery], multi, RECORD_SETTINGS, add=False) == [recovery]


# --- the cost of a loss, from the step log


def _log(seconds, pauses=()):
    """Step arrivals at PACE a second; ``pauses``: (time, seconds, steps) where the run stood
    still that long, then went back that many steps (a restart doing the steps since its
    checkpoint again)."""
    steps = []
    t = 0.0
    step = 0
    events = sorted(pauses)
    while t < seconds:
        if events and t >= events[0][0]:
            _, length, back = events.pop(0)
            t, step = t + length, step - back
        step += 1
        t += 1 / PACE
        steps.append((t, step))
    return steps


def test_an_undisturbed_run_costs_nothing_and_a_pause_costs_its_length():
    assert ft_recovery.loss_costs(_log(60), [15.0, 45.0]) == pytest.approx([0.0, 0.0], abs=0.03)
    assert ft_recovery.loss_costs(_log(60, pauses=[(15.0, 0.7, 0), (45.0, 2.0, 0)]), [15.0, 45.0]) == pytest.approx(
        [0.7, 2.0], abs=0.03
    )


def test_a_restart_s_redone_steps_count_as_lost():
    # 0.5 s still, then 150 steps done again: 0.5 + 1.5 s at 100 steps a second
    assert ft_recovery.loss_costs(_log(60, pauses=[(15.0, 0.5, 150)]), [15.0]) == pytest.approx([2.0], abs=0.03)


def test_losses_10_s_apart_each_get_a_cost_and_losses_too_close_get_none():
    log = _log(60, pauses=[(10.0, 1.0, 0), (20.0, 1.0, 0), (21.0, 1.0, 0)])
    assert ft_recovery.loss_costs(log, [10.0, 20.0]) == pytest.approx(
        [1.0, 2.0], abs=0.03
    )  # both pauses after 20 count
    assert ft_recovery.loss_costs(log, [10.0, 20.0, 21.0]) == pytest.approx(
        [1.0], abs=0.03
    )  # 20 and 21: no clean window


def test_the_longest_pause_is_found_after_the_first_step_and_not_past_the_replacement():
    """A survivor that steps on alone at once and waits 0.2 s at its next synchronization
    paused 0.2 s, though its first step came 10 ms after the kill; a pause after the
    replacement's first step (an epoch's end, say) is not the loss's."""
    steps = _log(3.0, pauses=[(1.05, 0.2, 0), (2.5, 0.4, 0)])
    killed = 1.0
    after = [(t, s) for t, s in steps if t > killed]
    assert ft_recovery.longest_pause(after, killed, until=1.3) == pytest.approx(0.2 + 1 / PACE, abs=1e-6)
    assert ft_recovery.longest_pause(after, killed, until=after[0][0] - killed) == pytest.approx(after[0][0] - killed)


def test_pace_counts_the_progress_made_in_each_window():
    steps = [(0.5 + 0.01 * k, k) for k in range(1, 1001)]  # 100 steps/s from 0.5 s to 10.5 s
    assert ft_recovery.pace(steps, width=5.0) == pytest.approx([90.0, 100.0, 10.0], abs=0.21)
    restart = [(1.0, 10), (2.0, 20), (3.0, 5), (4.0, 30)]  # a restart redoes steps: highest reached
    assert ft_recovery.pace(restart, width=2.0) == pytest.approx([10.0, 5.0])  # not back to 20 until 4 s
    assert ft_recovery.pace([]) == []
