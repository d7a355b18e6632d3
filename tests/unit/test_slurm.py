"""A task of SLURM's srun finds its place in the run from srun's variables (comm/slurm.py)."""

import pytest

from paratrain.comm.slurm import PORT_BASE, expand_hostlist, tasks_on_node
from paratrain.comm.transport import cluster_from_env
from paratrain.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("h0", ["h0"]),
        ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1-2].ib", ["rack1-n1.ib", "rack1-n2.ib", "rack2-n1.ib", "rack2-n2.ib"]),
        ("a,b[3],c", ["a", "b3", "c"]),
    ],
)
def test_a_hostlist_expands_as_scontrol_show_hostnames_does(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n[2-1]", "n[a-b]", "n]1[", ""])
def test_a_bad_hostlist_is_one_clear_error(text):
    with pytest.raises(ConfigError, match="SLURM node list"):
        expand_hostlist(text)


def test_tasks_per_node_read_with_repeats():
    assert [tasks_on_node("2(x3),1", node) for node in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="SLURM_NODEID 4"):
        tasks_on_node("2(x3),1", 4)


SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_an_srun_task_knows_its_place():
    cluster = cluster_from_env({**SRUN, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"})
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (3, 4, 1, 2)
    assert (cluster.master_addr, cluster.master_port, cluster.source) == ("node07", PORT_BASE + 4242, "slurm")
    mine = cluster_from_env({**SRUN, "SLURM_PROCID": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (mine.master_addr, mine.master_port) == ("10.0.0.1", 29400)


@pytest.mark.parametrize(
    "changes",
    [
        {"SLURM_STEP_ID": None},  # the batch script, not a task of srun
        {"SLURM_NTASKS": "1"},  # srun --pty bash: one shell
    ],
)
def test_outside_an_srun_step_of_several_tasks_a_process_runs_alone(changes):
    env = {**SRUN, "SLURM_PROCID": "0", **changes}
    assert cluster_from_env({k: v for k, v in env.items() if v is not None}) is None


def test_a_port_range_holds_the_port_derived_from_the_job():
    """Two SLURMs on one machine number their jobs from 1 alike: each run takes its port from
    its own PARATRAIN_PORT_RANGE (a test's job once met another test's run on 20003)."""
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_ID": "1"}
    assert cluster_from_env({**env, "PARATRAIN_PORT_RANGE": "22000-23999"}).master_port == 22000 + 4243 % 2000
    assert cluster_from_env({**env, "PARATRAIN_PORT_RANGE": "24000-24000"}).master_port == 24000
    with pytest.raises(ConfigError, match="PARATRAIN_PORT_RANGE must be LOW-HIGH"):
        cluster_from_env({**env, "PARATRAIN_PORT_RANGE": "22000"})


def test_torchrun_started_by_srun_wins():
    env = {**SRUN, "SLURM_PROCID": "1", "RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert cluster_from_env(env).source == "torchrun"


def test_one_task_per_node_runs_torchrun_for_its_node():
    from paratrain.launch.per_node import node_command

    env = {**SRUN, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    command = node_command(["train", "--procs-per-node", "4", "--strategy", "allreduce"], 4, env)
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "4",
        "--master-addr",
        "node07",
        "--master-port",
        str(PORT_BASE + 4242),
        "-m",
        "paratrain",
        "train",
        "--strategy",
        "allreduce",
    ]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({}, "--procs-per-node starts processes on each node of an srun step"),
        ({**SRUN, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}, "needs one srun task per node: this step runs 4 tasks"),
    ],
)
def test_procs_per_node_outside_one_task_per_node_is_refused(env, words):
    from paratrain.launch.per_node import node_command

    with pytest.raises(ConfigError, match=words):
        node_command(["train"], 2, env)


def _script(*argv):
    import subprocess

    from paratrain.launch.cli import build_parser
    from paratrain.launch.slurm_script import batch_script

    script = batch_script(build_parser(only="slurm").parse_args(["slurm", *argv]))
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # it parses
    return script


def test_the_batch_script_runs_one_task_per_process_and_requeues_a_stopped_run():
    script = _script(
        "--nodes",
        "2",
        "--tasks-per-node",
        "4",
        "--time",
        "02:00:00",
        "--gpus-per-task",
        "1",
        "--requeue",
        "--",
        "--strategy",
        "allreduce",
        "--checkpoint-dir",
        "ck",
    )
    lines = script.splitlines()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --time=02:00:00",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --signal=USR1@90",
        "#SBATCH --requeue",
        "srun paratrain train --strategy allreduce --checkpoint-dir ck --resume",
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0  # runs again, from that checkpoint',
    ):
        assert line in lines, line
    assert "if [ $code -eq 75 ]" in script and lines[-1] == "exit $code"


def test_a_run_without_checkpoints_gets_no_signal_and_no_resume():
    script = _script("--nodes", "1", "--tasks-per-node", "3", "--", "--strategy", "ps-sync", "--ps-shards", "1")
    assert "--signal" not in script and "--resume" not in script and "scontrol" not in script
    assert "srun paratrain train --strategy ps-sync --ps-shards 1" in script


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--nodes", "2", "--tasks-per-node", "2", "--", "--strategy", "allreduce", "--workers", "3"],
            "the cluster has 4 processes but --strategy allreduce with --workers 3 needs 3",
        ),
        (["--requeue", "--", "--strategy", "allreduce"], "--requeue goes on from checkpoints"),
        (["--time", "2 hours", "--", "--strategy", "allreduce"], "--time must be [D-]HH:MM:SS"),
        (["--nodes", "0"], "--nodes must be >= 1"),
    ],
)
def test_a_script_the_allocation_cannot_run_is_refused_in_one_line(argv, words):
    with pytest.raises(ConfigError) as error:
        _script(*argv)
    assert words in str(error.value)


def test_the_script_docs_clusters_md_shows_is_the_one_paratrain_slurm_writes():
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "clusters.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    shown = next(b for b in blocks if b.startswith("#!/bin/bash"))
    command = next(b for b in blocks if b.startswith("paratrain slurm")).replace("\\\n", " ")
    assert _script(*shlex.split(command)[2:]) == shown
