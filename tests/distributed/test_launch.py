"""Joining a cluster started by someone else (torchrun, a TF_CONFIG description), and the local
launcher's start-up."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed

from paratrain.comm import transport
from paratrain.comm.transport import ensure_process_group, free_port, parse_tf_config
from paratrain.errors import ConfigError, WorkerFailed
from paratrain.launch import replacing, supervisor
from paratrain.launch.local import launch
from paratrain.testing import alive, descendants, run_processes
from tests.conftest import torchrun_on_loopback

pytestmark = pytest.mark.distributed

TRAIN = ["train", "--strategy", "allreduce", "--epochs", "2", "--no-progress"]


def test_torchrun_runs_the_same_command(tmp_path):
    out = tmp_path / "m.json"
    command = torchrun_on_loopback(2, "-m", "paratrain", *TRAIN, "--metrics-out", str(out))
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2  # taken from torchrun's WORLD_SIZE
    assert metrics["global_steps"] == 2 * (1433 // 64)


def _tasks(argv, envs):
    """``paratrain ARGV`` in one process per environment of ``envs`` (over this one), as a
    cluster's launcher starts them; each must exit 0. Their (stdout, stderr)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "paratrain", *argv],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    outputs = [p.communicate(timeout=240) for p in processes]
    for process, (_stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    return outputs


def test_tf_config_cluster(tmp_path):
    cluster = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    out = tmp_path / "m.json"
    tasks = [{"type": "worker", "index": index} for index in range(2)]
    outputs = _tasks(
        [*TRAIN, "--metrics-out", str(out)], [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": t})} for t in tasks]
    )
    assert "done:" in outputs[0][0] and "done:" not in outputs[1][0]
    assert json.loads(out.read_text())["workers"] == 2


@pytest.mark.parametrize(
    ("flags", "tasks", "workers"),
    [
        (["--strategy", "allreduce"], 2, 2),
        # the roles of a PS run's processes from their ranks: test_roles, and under a real SLURM test_real_slurm
        pytest.param(["--strategy", "ps-sync", "--ps-shards", "1"], 3, 2, marks=pytest.mark.matrix),
    ],
)
def test_the_tasks_of_an_srun_step_form_one_run(tmp_path, flags, tasks, workers):
    """What ``srun -n TASKS paratrain train ...`` gives each task (its variables, set here as
    srun sets them on one host): one run of TASKS processes, not TASKS runs of one."""
    out = tmp_path / "m.json"
    slurm = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "MASTER_PORT": str(free_port()),
    }
    envs = [{**slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)} for task in range(tasks)]
    outputs = _tasks(["train", *flags, "--epochs", "1", "--no-progress", "--metrics-out", str(out)], envs)
    assert sum("done:" in stdout for stdout, _ in outputs) == 1
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == workers and metrics["global_steps"] == 1433 // (32 * workers)
    assert metrics["test_accuracy"] > 0.7  # one epoch of digits: 0.77 both ways, from 0.1


def test_one_srun_task_per_node_starts_the_node_s_processes(tmp_path):
    """``srun -N 2 --ntasks-per-node 1 paratrain train --procs-per-node 2``, its two nodes'
    tasks emulated on loopback: each starts 2 processes (torchrun's way), one run of 4."""
    out = tmp_path / "m.json"
    slurm = {
        "SLURM_JOB_ID": "78",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    envs = [{**slurm, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"} for node in range(2)]
    _tasks(
        [
            "train",
            "--procs-per-node",
            "2",
            "--strategy",
            "allreduce",
            "--epochs",
            "1",
            "--no-progress",
            "--metrics-out",
            str(out),
        ],
        envs,
    )
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 4 and metrics["global_steps"] == 1433 // (32 * 4)


def test_a_pytorchjob_s_four_variables_form_one_run(tmp_path):
    """What a Kubeflow PyTorchJob sets in each pod: MASTER_ADDR, MASTER_PORT, RANK and
    WORLD_SIZE, nothing else (no LOCAL_RANK, no torchrun agent): one run of 2 workers. Each
    pod is a machine of its own, with a GPU of its own where there are GPUs: the two pods
    emulated on one machine train on its CPU (on one GPU, both would take it for NCCL)."""
    out = tmp_path / "m.json"
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    command = [*TRAIN, "--device", "cpu", "--metrics-out", str(out)]
    outputs = _tasks(command, [{**base, "RANK": str(rank)} for rank in range(2)])
    assert sum("done:" in stdout for stdout, _ in outputs) == 1
    assert json.loads(out.read_text())["workers"] == 2


def test_tf_config_ranks_follow_ps_chief_worker_order():
    doc = {
        "cluster": {"worker": ["w0:1", "w1:1"], "chief": ["c:7"], "ps": ["p:9"]},
        "task": {"type": "worker", "index": 1},
    }
    env = parse_tf_config(json.dumps(doc))
    assert (env.rank, env.world_size, env.num_ps, env.master_addr, env.master_port) == (3, 4, 1, "p", 9)


@pytest.mark.parametrize(
    "doc, words",
    [
        ("not json", "TF_CONFIG must be JSON"),
        (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}), "task index 3"),
        (json.dumps({"cluster": {"evaluator": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}), "unknown job"),
        (json.dumps({"cluster": {"worker": ["nohost"]}, "task": {"type": "worker", "index": 0}}), "host:port"),
    ],
)
def test_bad_tf_config(doc, words):
    with pytest.raises(ConfigError, match=words):
        parse_tf_config(doc)


def test_ps_tasks_with_allreduce_are_bad_input(cli):
    doc = {"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    result = cli(*TRAIN, "--workers", "1", env={"TF_CONFIG": json.dumps(doc)})
    assert result.returncode == 2
    assert "parameter-server" in result.stderr.strip().splitlines()[-1]


def _join_unless_dying(dying):
    if int(os.environ["RANK"]) == dying:
        os.kill(os.getpid(), signal.SIGKILL)  # dies while the others form the group
    ensure_process_group("gloo", 30.0)
    return int(os.environ["RANK"])


def test_an_expendable_process_lost_before_the_group_formed_ends_the_run_at_once():
    """A ps-backup or ps-async worker may be lost mid-run, but not before it joined: the
    others cannot form the group without it, and would wait out the 30 s timeout."""
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        launch(_join_unless_dying, 2, num_processes=3, expendable=frozenset({2}))
    assert failure.value.rank == 2 and "SIGKILL" in str(failure.value)
    assert time.monotonic() - started < 15


def _join_then_die(dying):
    ensure_process_group("gloo", 30.0)
    torch.distributed.barrier()  # every process is in the group (not only this one)
    if int(os.environ["RANK"]) == dying:
        os.kill(os.getpid(), signal.SIGKILL)
    return int(os.environ["RANK"])


def test_an_expendable_process_lost_after_joining_leaves_the_others_to_finish():
    assert launch(_join_then_die, 2, num_processes=3, expendable=frozenset({2})) == [0, 1, None]


def test_the_processes_meet_where_the_launcher_listens_already(monkeypatch):
    """A port probed free and bound later by rank 0 can be taken in between (EADDRINUSE,
    once in a loaded suite run): the launcher hosts the run's store itself, on a port its
    own bind picks. Here every port a probe could hand out is taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for module in (transport, supervisor, replacing):
            monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": port, raising=False)
        assert launch(_join_then_die, -1, num_processes=2) == [0, 1]


def _variable(name):
    return os.environ.get(name)


def test_a_process_sees_the_launchers_environment_as_it_is_when_the_process_starts(monkeypatch):
    """Processes fork from a server started with the first launch; each still gets the
    launcher's environment of the moment, as a spawned process would."""
    assert launch(_variable, "PARATRAIN_TEST_VARIABLE", num_processes=1) == [None]
    monkeypatch.setenv("PARATRAIN_TEST_VARIABLE", "set later")
    assert launch(_variable, "PARATRAIN_TEST_VARIABLE", num_processes=2) == ["set later", "set later"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: a parent-death signal")
def test_no_process_outlives_a_launcher_killed_with_sigkill(tmp_path):
    progress = tmp_path / "m.json"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            "--strategy",
            "ps-async",
            "--workers",
            "2",
            "--epochs",
            "500",
            "--no-progress",
            "--log-every",
            "1",
            "--metrics-out",
            str(progress),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(run_processes(launcher.pid)) < 3 and time.monotonic() < deadline:  # the shard and 2 workers
        time.sleep(0.1)
    time.sleep(1.0)
    run = descendants(launcher.pid)  # multiprocessing's helpers too
    assert len(run_processes(launcher.pid)) == 3, run
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in run if alive(pid)]


def _waits_for_a_peer_that_never_comes(folder):
    Path(folder, f"ready-{os.environ['RANK']}").touch()
    time.sleep(120)


class _Interrupted(Exception):
    """What a test's timeout raises in the launcher (pytest-timeout's is a Failed)."""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_an_interrupted_launch_says_where_each_process_was(tmp_path):
    """A launcher stopped by an exception the run did not raise (here a signal's, as a test's
    timeout stops it) attaches every running process's thread stacks to that exception."""

    def interrupt(*_):
        raise _Interrupted("timed out")

    def interrupt_when_both_wait(main=threading.main_thread().ident):
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, interrupt)
    threading.Thread(target=interrupt_when_both_wait, daemon=True).start()
    try:
        with pytest.raises(_Interrupted) as info:
            launch(_waits_for_a_peer_that_never_comes, str(tmp_path), num_processes=2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    notes = "\n".join(info.value.__notes__)
    assert notes.count("was still running; its threads:") == 2
    assert notes.count("in _waits_for_a_peer_that_never_comes") == 2
