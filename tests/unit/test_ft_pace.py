"""benchmarks/ft_pace.py: a run's pace and each process's CPU, window by window."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ft_pace import Sampler, windows  # noqa: E402


def test_windows_give_steps_per_second_and_each_process_s_share_of_a_core():
    steps = [(k / 100, k) for k in range(1, 1001)]  # 100 steps a second for 10 s
    # cumulative CPU seconds, sampled every second: p1 at a full core, p2 at half of one,
    # p3 (a replacement) from 6 s on at a quarter
    samples = [(float(t), {"p1": t * 1.0, "p2": t * 0.5, **({"p3": (t - 6) * 0.25} if t >= 6 else {})})
               for t in range(10)]  # fmt: skip
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
