"""``paratrain train --procs-per-node N`` under ``srun`` with one task per node: each task
starts N processes on its node, as torchrun does, and the step's nodes make one run.

The task runs ``torchrun --nnodes NODES --node-rank SLURM_NODEID --nproc-per-node N`` with
the rendezvous on the first host of the step's node list and the port srun's tasks would
use (comm/slurm.py), and the same ``paratrain train`` command without ``--procs-per-node``:
global ranks follow the nodes (node ``i`` holds ranks ``i*N .. i*N+N-1``), so under a
parameter server the first node holds the shards, as in ``paratrain cluster run``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from paratrain.comm.slurm import in_srun_step, slurm_place, step_nodes
from paratrain.errors import ConfigError


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag N`` or ``--flag=N``)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(flag + "="):
            kept.append(item)
    return kept


def node_command(argv: Sequence[str], procs: int, env: Mapping[str, str]) -> list[str]:
    """The torchrun command this node's task runs for ``paratrain ARGV``."""
    if procs < 1:
        raise ConfigError(f"--procs-per-node must be >= 1, got {procs}")
    if not in_srun_step(env):
        raise ConfigError(
            "--procs-per-node starts processes on each node of an srun step of one task per node "
            "(srun --ntasks-per-node 1 paratrain train --procs-per-node N ...); elsewhere use --workers or torchrun"
        )
    place, nodes = slurm_place(env), step_nodes(env)
    tasks = place["local_world_size"]  # this node's tasks
    if tasks != 1 or place["world_size"] != len(nodes):
        raise ConfigError(
            f"--procs-per-node needs one srun task per node: this step runs {place['world_size']} tasks on "
            f"{len(nodes)} nodes ({tasks} here); use srun --ntasks-per-node 1"
        )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(len(nodes)),
        "--node-rank",
        env.get("SLURM_NODEID", "0"),
        "--nproc-per-node",
        str(procs),
        "--master-addr",
        str(place["master_addr"]),
        "--master-port",
        str(place["master_port"]),
        "-m",
        "paratrain",
        *without_flag(argv, "--procs-per-node"),
    ]


def per_node_command(argv: Sequence[str], procs: int) -> int:
    """Run this node's processes; their exit code."""
    return subprocess.call(node_command(argv, procs, os.environ))
