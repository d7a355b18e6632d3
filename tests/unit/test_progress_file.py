"""The launcher's progress file: each process's last step, and the ranks given up for good."""

import time

from paratrain import timeline
from paratrain.train.faults import LOST, lost_ranks, mark_lost, new_progress, read_progress


def test_ranks_marked_lost_read_back_through_the_run_s_variable(tmp_path, monkeypatch):
    path = tmp_path / "progress"
    new_progress(path, 4)
    monkeypatch.setenv("PARATRAIN_PROGRESS", str(path))
    assert lost_ranks(4) == set()
    mark_lost(path, [2, 3])
    assert read_progress(path, 4) == [0, 0, LOST, LOST]
    assert lost_ranks(4) == {2, 3}
    monkeypatch.delenv("PARATRAIN_PROGRESS")
    assert lost_ranks(4) == set()  # no launcher watches: none is given up


def test_a_merge_takes_the_parts_there_and_waits_for_no_lost_rank(tmp_path):
    trace = tmp_path / "t.json"
    for rank in (0, 1):
        timeline.start(rank, f"worker {rank}")
        with timeline.span("forward"):
            pass
        timeline.stop().write_part(trace)
    began = time.monotonic()
    merged = timeline.merge(trace, 3, timeout=30, lost=lambda: {2})
    assert time.monotonic() - began < 10  # not the timeout: rank 2 writes no part
    assert merged["otherData"]["missing_ranks"] == ["rank-2"]
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1}
