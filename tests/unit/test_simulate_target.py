"""``paratrain simulate --target-accuracy`` / ``--target-loss``: each strategy trains the real
model on its simulated schedule, and the strategies are ranked by simulated time to the target."""

import json

import pytest

from paratrain.launch.cli import main

RUN = ["simulate", "--compute-ms", "1", "--workers", "2", "--epochs", "4", "--seeds", "2"]


def _targets(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    assert main([*RUN, *flags, "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_strategies_are_ranked_by_time_to_the_target_and_a_lower_one_comes_no_later(tmp_path, capsys):
    strategies = ["--strategy", "allreduce,ps-sync,local-sgd", "--ps-message-us", "300"]
    high = _targets(tmp_path, "high", *strategies, "--target-accuracy", "0.9")
    out = capsys.readouterr().out
    low = _targets(tmp_path, "low", *strategies, "--target-accuracy", "0.8")
    medians = [r["median_seconds"] for r in high["targets"]]
    assert None not in medians and medians == sorted(medians)  # fastest first
    assert high["recommendation"].startswith("on this cluster, 2 workers, to test accuracy 0.9: ")
    assert high["recommendation"] in " ".join(out.split())
    first = high["targets"][0]
    assert f"{first['strategy']} in {first['median_seconds']:.3g} s" in high["recommendation"]
    for row in high["targets"]:
        assert len(row["seconds"]) == 2 and row["reached"] == 2
        lower = next(r for r in low["targets"] if r["strategy"] == row["strategy"])
        assert all(a <= b for a, b in zip(lower["seconds"], row["seconds"], strict=True)), (lower, row)
    # ps-sync's shard work (300 us a push) makes its steps slower than allreduce's: same updates, later
    seconds = {r["strategy"]: r["median_seconds"] for r in high["targets"]}
    assert seconds["ps-sync"] > seconds["allreduce"]


def test_a_target_not_reached_ranks_last_and_is_said_so(tmp_path):
    result = _targets(tmp_path, "never", "--strategy", "allreduce", "--target-loss", "0.0001")
    (row,) = result["targets"]
    assert row["median_seconds"] is None and row["seconds"] == [None, None]
    assert "allreduce not in most seeds within 4 epochs (0 of 2)" in result["recommendation"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--target-accuracy", "0.9", "--target-loss", "0.1"], "give one target"),
        (["--target-accuracy", "1.5"], "--target-accuracy must be in (0, 1]"),
        (["--target-loss", "-1"], "--target-loss must be > 0"),
        (["--target-accuracy", "0.9", "--workers", "2,4"], "one --workers count"),
        (["--target-accuracy", "0.9", "--strategy", "diloco"], "diloco's outer optimizer is not modelled"),
        (["--target-accuracy", "0.9", "--seeds", "0"], "--seeds must be >= 1"),
    ],
)
def test_bad_targets_are_one_line_and_exit_2(capsys, flags, words):
    assert main(["simulate", "--compute-ms", "1", "--workers", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_seed_that_misses_the_target_counts_as_later_than_any_that_reaches_it():
    """Reached in 2 of 3 seeds, a strategy has the later of the two as its median and ranks
    before one that took longer in every seed; missed in most, it ranks last."""
    import argparse

    from paratrain.simulate.target import censored_median, recommendation

    assert censored_median([0.5, None, 0.6]) == 0.6
    assert censored_median([1.0, 3.0, 2.0]) == 2.0
    assert censored_median([0.4, None, None]) is None and censored_median([None, 0.4]) is None
    rows = [
        {
            "strategy": name,
            "seconds": seconds,
            "median_seconds": censored_median(seconds),
            "reached": sum(s is not None for s in seconds),
        }
        for name, seconds in [
            ("local-sgd", [0.5, None, 0.6]),
            ("ps-backup", [1.2, 1.3, 1.4]),
            ("ps-async", [0.1, None, None]),
        ]
    ]
    rows.sort(key=lambda r: (r["median_seconds"] is None, r["median_seconds"] or 0.0))
    args = argparse.Namespace(target_accuracy=0.95, target_loss=None, epochs=10)
    assert recommendation(rows, args, 5) == (
        "on this cluster, 5 workers, to test accuracy 0.95: local-sgd in 0.6 s (0.5-0.6; 2 of 3 seeds), "
        "ps-backup in 1.3 s (1.2-1.4), ps-async not in most seeds within 10 epochs (1 of 3)"
    )
