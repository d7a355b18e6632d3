"""benchmarks/loss_cost.py: the cost of a loss, read from a run's own step log."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from loss_cost import longest_pause, loss_costs, pace  # noqa: E402

PACE = 100  # steps a second


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
    assert loss_costs(_log(60), [15.0, 45.0]) == pytest.approx([0.0, 0.0], abs=0.03)
    assert loss_costs(_log(60, pauses=[(15.0, 0.7, 0), (45.0, 2.0, 0)]), [15.0, 45.0]) == pytest.approx(
        [0.7, 2.0], abs=0.03
    )


def test_a_restart_s_redone_steps_count_as_lost():
    # 0.5 s still, then 150 steps done again: 0.5 + 1.5 s at 100 steps a second
    assert loss_costs(_log(60, pauses=[(15.0, 0.5, 150)]), [15.0]) == pytest.approx([2.0], abs=0.03)


def test_losses_10_s_apart_each_get_a_cost_and_losses_too_close_get_none():
    log = _log(60, pauses=[(10.0, 1.0, 0), (20.0, 1.0, 0), (21.0, 1.0, 0)])
    assert loss_costs(log, [10.0, 20.0]) == pytest.approx([1.0, 2.0], abs=0.03)  # both pauses after 20 count
    assert loss_costs(log, [10.0, 20.0, 21.0]) == pytest.approx([1.0], abs=0.03)  # 20 and 21: no clean window


def test_the_longest_pause_is_found_after_the_first_step_and_not_past_the_replacement():
    """A survivor that steps on alone at once and waits 0.2 s at its next synchronization
    paused 0.2 s, though its first step came 10 ms after the kill; a pause after the
    replacement's first step (an epoch's end, say) is not the loss's."""
    steps = _log(3.0, pauses=[(1.05, 0.2, 0), (2.5, 0.4, 0)])
    killed = 1.0
    after = [(t, s) for t, s in steps if t > killed]
    assert longest_pause(after, killed, until=1.3) == pytest.approx(0.2 + 1 / PACE, abs=1e-6)
    assert longest_pause(after, killed, until=after[0][0] - killed) == pytest.approx(after[0][0] - killed)


def test_pace_counts_the_progress_made_in_each_window():
    steps = [(0.5 + 0.01 * k, k) for k in range(1, 1001)]  # 100 steps/s from 0.5 s to 10.5 s
    assert pace(steps, width=5.0) == pytest.approx([90.0, 100.0, 10.0], abs=0.21)
    restart = [(1.0, 10), (2.0, 20), (3.0, 5), (4.0, 30)]  # a restart redoes steps: highest reached
    assert pace(restart, width=2.0) == pytest.approx([10.0, 5.0])  # not back to 20 until 4 s
    assert pace([]) == []
