"""The machine's cores shared among every paratrain process on it (launch/host_share.py)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from paratrain.launch.host_share import CHECK_SECONDS, HostShare, share
from paratrain.launch.threads import leave_cores, usable_cores
from paratrain.train.cpu_tuning import CpuTuning
from paratrain.train.trainer import Trainer


def _entry(pid=1, cores=(0, 1), threads=1, fixed=False):
    return {"pid": pid, "started": "1", "cores": list(cores), "threads": threads, "fixed": fixed}


def test_a_share_sets_aside_the_fixed_threads_and_divides_the_rest():
    assert share([], [0, 1, 2, 3], 4, 1) == 4  # alone: every core
    assert share([_entry(), _entry()], [0, 1, 2, 3], 4, 1) == 1  # 3 processes on 4 cores
    assert share([_entry(fixed=True, threads=2)], [0, 1, 2, 3], 4, 1) == 2  # 2 cores taken
    assert share([_entry(fixed=True, threads=8)], [0, 1, 2, 3], 4, 1) == 1  # never zero
    assert share([_entry()], [0, 1, 2, 3], 16, 4) == 4  # its own run's 4 processes, not yet listed
    assert share([_entry(cores=(2, 3))], [0, 1], 2, 1) == 2  # a process on other cores shares none


@pytest.fixture
def sleeper():
    """Another live process, to list as a paratrain process."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def _list(folder, process, threads, fixed):
    started = open(f"/proc/{process.pid}/stat").read().rpartition(")")[2].split()[19]
    line = {
        "pid": process.pid,
        "started": started,
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": threads,
        "fixed": fixed,
    }
    (folder / f"{process.pid}.json").write_text(json.dumps(line))


def _until(condition, seconds=10 * CHECK_SECONDS):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(usable_cores() < 2, reason="a share of one core is one thread: nothing to see")
def test_a_process_on_the_default_follows_the_processes_that_come_and_go(tmp_path, sleeper):
    cores = usable_cores()
    before = torch.get_num_threads()
    mine = HostShare(cores, False, cores, 1, tmp_path).join()
    try:
        assert mine.threads == cores and json.loads((tmp_path / f"{os.getpid()}.json").read_text())["threads"] == cores
        _list(tmp_path, sleeper, cores, fixed=True)  # another run took every core
        assert _until(lambda: mine.wanted == 1)
        assert mine.apply() and mine.threads == 1 and torch.get_num_threads() == 1
        assert json.loads((tmp_path / f"{os.getpid()}.json").read_text())["threads"] == 1  # the others see it
        sleeper.kill()
        sleeper.wait()
        assert _until(lambda: mine.wanted == cores)  # it ended without a word: found dead
        assert mine.apply() and torch.get_num_threads() == cores
        assert not (tmp_path / f"{sleeper.pid}.json").exists()  # its line removed
        assert mine.changes == [(cores, 1), (1, cores)]
    finally:
        mine.leave()
        torch.set_num_threads(before)
    assert not (tmp_path / f"{os.getpid()}.json").exists()


def test_threads_chosen_for_a_process_are_kept_and_counted_by_the_others(tmp_path, sleeper):
    before = torch.get_num_threads()
    _list(tmp_path, sleeper, 1, fixed=False)
    fixed = HostShare(1, True, usable_cores(), 1, tmp_path).join()
    try:
        assert fixed.wanted == 1 and not fixed.apply()  # no share taken: it keeps its threads
        line = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
        assert line["fixed"] and line["threads"] == 1  # what the others set aside
        assert [entry["pid"] for entry in fixed.others()] == [sleeper.pid]
    finally:
        fixed.leave()
        torch.set_num_threads(before)


def test_a_process_with_chosen_threads_clears_the_lines_of_the_dead_as_it_joins(tmp_path, sleeper):
    # processes killed without a word (SIGKILL) where every process had its threads chosen
    # (no poller): their lines would pile up in the machine's folder
    _list(tmp_path, sleeper, 1, fixed=True)
    sleeper.kill()
    sleeper.wait()
    fixed = HostShare(1, True, usable_cores(), 1, tmp_path).join()
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"{os.getpid()}.json"]
    finally:
        fixed.leave()


def test_a_folder_that_cannot_be_written_keeps_the_threads_it_started_with(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    mine = HostShare(2, False, 2, 1, blocked / "registry").join()
    assert mine.threads == 2 and not mine.apply()
    mine.leave()


@pytest.mark.skipif(usable_cores() < 2, reason="a share of one core is one thread: nothing to see")
def test_a_run_on_the_default_takes_its_share_beside_another_run(cli, tmp_path, sleeper):
    """paratrain train on the default threads, with every core taken by another listed
    process: one compute thread, where alone it takes every core (test_threads.py)."""
    registry = tmp_path / "registry"
    registry.mkdir()
    _list(registry, sleeper, usable_cores(), fixed=True)
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
        env={"PARATRAIN_THREADS_PER_WORKER": "", "PARATRAIN_HOST_REGISTRY": str(registry)},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["threads_per_worker"] == 1
    assert [p.name for p in registry.iterdir()] == [f"{sleeper.pid}.json"]  # the run's line left with it


@pytest.mark.skipif(usable_cores() < 2, reason="a share of one core is one thread: nothing to see")
def test_the_python_api_takes_the_same_share(tmp_path, sleeper, monkeypatch):
    """A Trainer of the user's script shares the cores as paratrain train does; CpuTuning(threads=N)
    keeps N, listed for the others to count."""
    monkeypatch.delenv("PARATRAIN_THREADS_PER_WORKER", raising=False)
    monkeypatch.setenv("PARATRAIN_HOST_REGISTRY", str(tmp_path))
    _list(tmp_path, sleeper, usable_cores(), fixed=True)
    before = torch.get_num_threads()
    model = torch.nn.Linear(4, 2)
    try:
        trainer = Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
        assert trainer.cores.threads == 1 and torch.get_num_threads() == 1
        trainer = Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1), cpu=CpuTuning(threads=2))
        assert torch.get_num_threads() == 2
        line = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
        assert line["fixed"] and line["threads"] == 2
    finally:
        leave_cores()
        torch.set_num_threads(before)
    assert not (tmp_path / f"{os.getpid()}.json").exists()
