"""benchmarks/ft_versus.py's bookkeeping: the fault-tolerant run and the restarts, killed
alike, both kept against the plain run without checkpoints, and how far one is ahead of the other."""

import json
import sys

import ft_versus
import pytest

# a run's seconds by its name and interval between kills (0: undisturbed)
SECONDS = {
    ("local-sgd (plain)", 0.0): 100.0,
    ("local-sgd-ft", 30.0): 102.0,
    ("local-sgd (restart)", 30.0): 110.0,
    ("local-sgd-ft", 10.0): 105.0,
    ("local-sgd (restart)", 10.0): 140.0,
}


@pytest.fixture
def runs(monkeypatch):
    """Record every run asked for, in order, instead of training for minutes."""
    asked = []

    def train(model, strategy, extra, folder, kill_every=0, kills=0, longer=1, cluster=None):
        asked.append((strategy, kill_every, kills, tuple(extra), longer))
        losses = [(30.0 * k, "paratrain: worker 1 was lost (killed by SIGKILL) after step 3") for k in range(kills)]
        return {
            "steps": [(t / 10, t) for t in range(1, 1000)],
            "errors": losses,
            "metrics": {"test_accuracy": 0.9},
            "seconds": SECONDS[strategy, float(kill_every)],
            "steal": 0.0,
        }

    monkeypatch.setattr(ft_versus, "train", train)
    monkeypatch.setattr(ft_versus, "sized", lambda model, strategy, minutes, cluster: 7)
    monkeypatch.setattr(ft_versus, "cpu_name", lambda: "cpu (AVX2)")
    return asked


def test_a_set_runs_the_plain_run_once_and_each_disturbed_run_the_same_command(runs):
    pairs = ft_versus.one_set("cifar_cnn", "local-sgd", [(30.0, 9), (10.0, 27)], 7, backwards=False)
    assert [(s, e) for s, e, *_ in runs] == [
        ("local-sgd (plain)", 0.0),
        ("local-sgd-ft", 30.0),
        ("local-sgd (restart)", 30.0),
        ("local-sgd-ft", 10.0),
        ("local-sgd (restart)", 10.0),
    ]
    # the plain run without --max-restarts; the disturbed ones all with room for the most kills
    assert [extra for _, _, _, extra, _ in runs] == [(), *[("--max-restarts", "27")] * 4]
    assert {longer for *_, longer in runs} == {7}
    assert [p["kept"] for p in pairs] == pytest.approx([100 / 102, 100 / 110, 100 / 105, 100 / 140])
    assert {p["undisturbed_seconds"] for p in pairs} == {100.0}
    runs.clear()
    ft_versus.one_set("cifar_cnn", "local-sgd", [(30.0, 9)], 7, backwards=True)
    assert [(s, e) for s, e, *_ in runs] == [
        ("local-sgd (restart)", 30.0),
        ("local-sgd-ft", 30.0),
        ("local-sgd (plain)", 0.0),
    ]


def test_sets_added_later_go_on_alternating_and_say_how_far_ahead(runs, tmp_path, monkeypatch):
    out = tmp_path / "versus"
    argv = ["ft_versus.py", "--strategy", "local-sgd", "--every", "30,10", "--kills", "9,27", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--sets", "2"])
    ft_versus.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--sets", "1", "--add"])
    ft_versus.main()
    firsts = [s for s, e, *_ in runs if (s, e) != ("local-sgd (plain)", 0.0)][::4]
    assert firsts == ["local-sgd-ft", "local-sgd (restart)", "local-sgd-ft"]  # the third set: forward again
    document = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["strategy"], r["every"]): r for r in document["rows"]}
    assert len(rows[("local-sgd-ft", 30.0)]["runs"]) == 3
    # the record keeps 4 significant digits (recorded_table.small_json)
    assert rows[("local-sgd (restart)", 10.0)]["kept"] == pytest.approx(100 / 140, rel=1e-3)
    assert ft_versus.ahead(document["rows"], "local-sgd", 10.0) == pytest.approx([140 / 105] * 3, rel=1e-3)
    table = out.with_suffix(".md").read_text()
    assert table.index("every 30 s") < table.index("every 10 s")
    assert (
        "`local-sgd-ft` ahead of `local-sgd (restart)` (the restarts' seconds over its own, per set): 108% (108%-108%) over 3 sets"
        in table
    )


def test_adding_sets_of_other_settings_is_refused(runs, tmp_path, monkeypatch):
    out = tmp_path / "versus"
    monkeypatch.setattr(sys, "argv", ["ft_versus.py", "--strategy", "local-sgd", "--out", str(out)])
    ft_versus.main()
    monkeypatch.setattr(
        sys,
        "argv",
        ["ft_versus.py", "--strategy", "local-sgd", "--every", "10", "--kills", "27", "--add", "--out", str(out)],
    )
    with pytest.raises(SystemExit) as stopped:
        ft_versus.main()
    assert stopped.value.code == 2
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"][0]["runs"]) == 1
