"""benchmarks/ft_pace.py: a run's pace and each process's CPU, window by window."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ft_pace import SETTLE, Sampler, between, phase_lines, phases, windows  # noqa: E402


def test_windows_give_steps_per_second_and_each_process_s_share_of_a_core():
    steps = [(k / 100, k) for k in range(1, 1001)]  # 100 steps a second for 10 s
    # cumulative CPU seconds, sampled every second: p1 at a full core, p2 at half of one,
    # p3 (a replacement) from 6 s on at a quarter
    samples = [
        (float(t), {"p1": t * 1.0, "p2": t * 0.5, **({"p3": (t - 6) * 0.25} if t >= 6 else {})}) for t in range(10)
    ]
    table = windows(samples, steps, 5.0)
    assert [w["at"] for w in table] == [0.0, 5.0]
    assert [w["steps_per_s"] for w in table] == pytest.approx([100, 100], abs=0.5)
    # the first window counts from 0 to its last sample (4 s of CPU in 5 s), the second
    # from that sample to its own last one
    assert table[0]["cpu"] == pytest.approx({"p1": 0.8, "p2": 0.4})
    assert table[1]["cpu"] == pytest.approx({"p1": 1.0, "p2": 0.5, "p3": 0.15})


def test_processes_are_named_by_role_in_the_order_they_start():
    sampler = Sampler()
    me = os.getpid()
    assert sampler._role(10, me, b"python -m paratrain train") == "launcher"
    assert sampler._role(11, 10, b"python -c from multiprocessing.resource_tracker import main") == "resource tracker"
    assert sampler._role(12, 10, b"python -c from multiprocessing.forkserver import main") == "fork server"
    assert sampler._role(13, 12, b"python -c from multiprocessing.forkserver import main") == "p1"
    assert sampler._role(14, 12, b"python -c from multiprocessing.forkserver import main") == "p2"
    assert sampler._role(13, 12, b"") == "p1"  # a role is kept
    assert sampler._role(15, 12, b"python -c from multiprocessing.forkserver import main") == "p3"
    assert sampler._role(16, 13, b"python helper") == "other (p1)"


def test_phases_give_each_rank_s_pace_and_milliseconds_per_step_in_each_phase():
    began = 1_000.0  # the benchmark's wall clock at the start; the trace's origin 2 s later
    # one step's spans: (name, seconds after the step's start, milliseconds)
    step = [
        ("quorum", 0.0, 1.0),
        ("allreduce", 0.1, 3.0),
        ("forward", 0.2, 0.5),
        ("backward", 0.3, 0.5),
        ("optimizer", 0.4, 0.5),
        ("data", 0.5, 0.25),
        ("evaluate", 0.6, 0.25),
        ("checkpoint", 0.7, 5.0),
    ]
    spans = [(n, 0, at + t, ms) for at in (0.0, 1.0) for n, t, ms in step]  # rank 0: two steps
    spans += [(n, 1, 3.0 + t, ms * 2) for n, t, ms in step]  # rank 1: one step, twice as slow, later
    spans.append(("quorum", 0, 7.0, 1.0))  # a step that applied no update
    events = [{"name": n, "ph": "X", "pid": r, "tid": 0, "ts": t * 1e6, "dur": ms * 1e3} for n, r, t, ms in spans]
    events.append(
        {"name": "allreduce", "ph": "X", "pid": 1, "tid": 1, "ts": 3e6, "dur": 1e3}
    )  # a comm hook's: not counted
    trace = {"traceEvents": events, "otherData": {"origin_unix_us": (began + 2.0) * 1e6}}
    table = phases(trace, began, 4.0)
    # rank 0's steps (the trace's 0-2 s) fall in the benchmark's first 4 s, rank 1's in the
    # next; the last window applied no update; a checkpoint is none of the phases
    assert [w["at"] for w in table] == [0.0, 4.0, 8.0]
    assert table[0]["ranks"] == {0: {"steps_per_s": 0.5, "quorum": 1.0, "all-reduce": 3.0, "compute": 1.5, "rest": 0.5}}
    assert table[1]["ranks"] == {1: {"steps_per_s": 0.2, "quorum": 2.0, "all-reduce": 6.0, "compute": 3.0, "rest": 1.0}}
    assert table[2]["ranks"] == {}
    lines = phase_lines(table)
    assert lines[0].startswith("| from (s) | rank 0 steps/s | rank 0 quorum | rank 0 all-reduce")
    assert lines[2:] == [
        "| 0 | 0 | 1.00 | 3.00 | 1.50 | 0.50 |  |  |  |  |  |",
        "| 4 |  |  |  |  |  | 0 | 2.00 | 6.00 | 3.00 | 1.00 |",
        "| 8 |  |  |  |  |  |  |  |  |  |  |",
    ]


def test_the_pace_before_the_first_loss_and_between_losses_shows_a_lasting_slowdown():
    # 2 s of start-up, 10 steps a second to the loss at 20.4 s, a pause of 2 s, then 8 a second
    seconds = [0.0, 0.0] + [10.0] * 18 + [4.0, 0.0] + [8.0] * 17 + [3.0]
    assert SETTLE == 6
    # before: seconds 8-19 (6 s after the first step); after: 27 to the last whole second (38)
    assert between(seconds, [20.4]) == pytest.approx([10.0, 8.0])
    assert between(seconds, []) == pytest.approx([sum(seconds[8:39]) / 31])
    # a loss too close to the next leaves no stretch between them
    assert len(between(seconds, [20.4, 24.0])) == 2
