"""paratrain under a real SLURM on this machine (paratrain/testing_slurm.py: munge on a
private socket, slurmctld and one slurmd, all removed after): the tasks of an srun step
form one run, and the batch script ``paratrain slurm`` writes runs to COMPLETED."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.cluster.hosts import EmulatedCluster, HostSpec
from paratrain.testing_slurm import LocalSlurm, missing
from tests.conftest import hosts_missing

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def slurm():
    cluster = LocalSlurm()
    yield cluster
    cluster.stop()


def test_the_tasks_of_srun_form_one_run(slurm, tmp_path):
    out = tmp_path / "m.json"
    result = slurm.run(
        "srun",
        "-n",
        "2",
        sys.executable,
        "-m",
        "paratrain",
        "train",
        "--strategy",
        "allreduce",
        "--epochs",
        "1",
        "--no-progress",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done:") == 1  # one run, whose chief reports it
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["global_steps"] == 1433 // 64 and metrics["test_accuracy"] > 0.7


@pytest.mark.matrix  # the suite runs the same script over three nodes (below)
def test_the_batch_script_of_paratrain_slurm_runs_a_parameter_server_to_completed(slurm, tmp_path):
    """3 tasks: 1 shard and 2 workers, the job COMPLETED."""
    out = tmp_path / "m.json"
    env = {**slurm.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    submitted = slurm.run(
        sys.executable,
        "-m",
        "paratrain",
        "slurm",
        "--tasks-per-node",
        "3",
        "--time",
        "00:05:00",
        "--submit",
        "--",
        "--strategy",
        "ps-sync",
        "--ps-shards",
        "1",
        "--epochs",
        "1",
        "--no-progress",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
        env=env,
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = submitted.stdout.split()[-1]  # "Submitted batch job N"
    assert slurm.wait_for_job(job) == "COMPLETED", (tmp_path / f"paratrain-{job}.out").read_text()[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["ps_shards"] == 1 and metrics["test_accuracy"] > 0.7


def test_a_job_warned_of_its_time_limit_stops_requeues_itself_and_ends_as_the_uninterrupted_run(slurm, tmp_path, cli):
    """What ``--signal=USR1@90`` sends before the time limit, sent now (``scancel --signal=USR1``)
    once the run has a checkpoint: the run stops at an agreed step with its checkpoint (exit
    75), the script requeues the job, the job runs again with --resume and COMPLETES with the
    test loss of the run that was never stopped, to the bit."""
    out, folder = tmp_path / "m.json", tmp_path / "ck"
    run = [
        "--strategy",
        "allreduce",
        "--epochs",
        "40",
        "--no-progress",
        "--checkpoint-dir",
        str(folder),
        "--checkpoint-every",
        "50",
        "--metrics-out",
        str(out),
    ]
    env = {**slurm.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    submitted = slurm.run(
        sys.executable,
        "-m",
        "paratrain",
        "slurm",
        "--tasks-per-node",
        "2",
        "--time",
        "00:10:00",
        "--requeue",
        "--submit",
        "--",
        *run,
        cwd=tmp_path,
        env=env,
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = submitted.stdout.split()[-1]
    deadline = time.monotonic() + 120
    while not (folder / "ckpt-000000050").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = tmp_path / f"paratrain-{job}.out"
    state = slurm.job(job).get("JobState")
    assert (folder / "ckpt-000000050").exists(), f"{state}: {log.read_text()[-3000:] if log.exists() else 'no log'}"
    warned = slurm.run("scancel", "--signal=USR1", job)
    assert warned.returncode == 0, f"{warned.stderr} {state}: {log.read_text()[-3000:]}"
    assert slurm.wait_for_job(job) == "COMPLETED", log.read_text()[-3000:]
    assert slurm.job(job)["Restarts"] == "1"
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] >= 50 and resumed["global_steps"] == 40 * (1433 // 64)
    whole = cli("train", "--workers", "2", *run[:5], "--metrics-out", str(tmp_path / "whole.json"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert resumed["test_loss"] == json.loads((tmp_path / "whole.json").read_text())["test_loss"]


@pytest.fixture(scope="module")
def slurm_on_hosts():
    """A SLURM of three nodes, one slurmd on each of three emulated hosts (network
    namespaces on a bridge, 0.6 of a core each); the controller on the bridge. Afterwards
    nothing of it is left: no daemon, namespace, link or /etc/hosts entry."""
    if hosts_missing():
        pytest.skip(hosts_missing())
    with EmulatedCluster([HostSpec(cpu=0.6) for _ in range(3)]) as hosts:
        cluster = LocalSlurm(hosts=hosts)
        try:
            yield cluster, hosts
        finally:
            cluster.stop()


def _on_hosts(slurm):
    """A job's environment on the emulated hosts: without the suite's loopback interface
    for Gloo (conftest.py), which reaches no other host."""
    env = {**slurm.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def test_a_batch_job_over_two_nodes_is_one_run_across_the_hosts(slurm_on_hosts, tmp_path):
    """paratrain slurm --nodes 2: one task on each of two nodes (two hosts, two network
    namespaces, names that resolve), one allreduce run of 2 workers, the job COMPLETED."""
    slurm, hosts = slurm_on_hosts
    where = slurm.run("srun", "-N", "2", "-n", "2", "hostname", env=_on_hosts(slurm))
    assert sorted(where.stdout.split()) == slurm.nodes[:2], where.stderr
    out = tmp_path / "m.json"
    submitted = slurm.run(
        sys.executable,
        "-m",
        "paratrain",
        "slurm",
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--time",
        "00:05:00",
        "--submit",
        "--",
        "--strategy",
        "allreduce",
        "--epochs",
        "1",
        "--no-progress",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
        env=_on_hosts(slurm),
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = submitted.stdout.split()[-1]
    log = tmp_path / f"paratrain-{job}.out"
    assert slurm.wait_for_job(job) == "COMPLETED", log.read_text()[-3000:]
    assert slurm.job(job)["NodeList"] == f"{hosts.prefix}host[0-1]"
    assert log.read_text().count("done:") == 1
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["global_steps"] == 1433 // 64 and metrics["test_accuracy"] > 0.7


def test_paratrain_slurms_script_runs_a_parameter_server_over_three_nodes_to_completed(slurm_on_hosts, tmp_path):
    """--nodes 3 --tasks-per-node 1: the shard on the first node, a worker on each of the others."""
    slurm, hosts = slurm_on_hosts
    out = tmp_path / "m.json"
    submitted = slurm.run(
        sys.executable,
        "-m",
        "paratrain",
        "slurm",
        "--nodes",
        "3",
        "--tasks-per-node",
        "1",
        "--time",
        "00:05:00",
        "--submit",
        "--",
        "--strategy",
        "ps-sync",
        "--ps-shards",
        "1",
        "--epochs",
        "1",
        "--no-progress",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
        env=_on_hosts(slurm),
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = submitted.stdout.split()[-1]
    assert slurm.wait_for_job(job) == "COMPLETED", (tmp_path / f"paratrain-{job}.out").read_text()[-3000:]
    assert slurm.job(job)["NodeList"] == f"{hosts.prefix}host[0-2]"
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["ps_shards"] == 1 and metrics["test_accuracy"] > 0.7


def test_a_slurm_on_emulated_hosts_leaves_nothing_behind():
    """Its nodes' names resolve while it runs; after stop() and the hosts' close, no daemon,
    /etc/hosts entry, namespace, link or cgroup of theirs is left."""
    if hosts_missing():
        pytest.skip(hosts_missing())
    with EmulatedCluster([HostSpec(cpu=0.5), HostSpec(cpu=0.5)]) as hosts:
        slurm = LocalSlurm(hosts=hosts)
        try:
            resolved = subprocess.run(["getent", "hosts", slurm.nodes[1]], capture_output=True, text=True).stdout
            assert resolved.split()[0] == hosts.hosts[1].address
        finally:
            slurm.stop()
        daemons = subprocess.run(["pgrep", "-f", str(slurm.folder)], capture_output=True, text=True).stdout
        assert daemons == "" and slurm._marker not in Path("/etc/hosts").read_text()
    assert hosts.leftovers() == []
