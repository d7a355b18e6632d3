"""A process's place in a run started by SLURM's ``srun``, one task per process.

``srun -N2 --ntasks-per-node 2 paratrain train ...`` starts four tasks; each reads its rank
from ``SLURM_PROCID``, the run's size from ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), its place on its
node from ``SLURM_LOCALID`` and the number of tasks there from ``SLURM_STEP_TASKS_PER_NODE``
(``2(x2)``) and ``SLURM_NODEID``. The rendezvous is on the first host of the step's node list
(``SLURM_STEP_NODELIST``, a hostlist expression such as ``node[01-04,07],gpu-a[1-2]``,
expanded as ``scontrol show hostnames`` does), on a port derived from the job and step ids
(within ``PARATRAIN_PORT_RANGE`` where it is set; ``MASTER_ADDR`` and ``MASTER_PORT``, where
set, win). The batch script itself, not started
by ``srun``, has no step id, and a step of one task (``srun --pty bash``) is one shell: a
``paratrain train`` there runs as it would outside SLURM, starting its own processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from paratrain.comm.ports import port_range
from paratrain.errors import ConfigError

#: Rendezvous ports derived from the job id: PORT_BASE + (job + step) mod PORT_SPAN, clear of
#: the ephemeral range (32768 up, Linux's default) that connections take their ports from;
#: within ``PARATRAIN_PORT_RANGE`` where it is set (comm/ports.py).
PORT_BASE, PORT_SPAN = 20000, 10000

_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """The hosts of a SLURM hostlist expression, in its order: ``node[01-03,07],gpu-a[1-2]``
    -> node01, node02, node03, node07, gpu-a1, gpu-a2 (a range keeps the width of its first
    number; several bracket groups in one name multiply)."""
    hosts: list[str] = []
    for item in _top_level_items(text):
        hosts.extend(_expand_item(item, text))
    if not hosts:
        raise ConfigError(f"SLURM node list {text!r} names no host")
    return hosts


def _top_level_items(text: str) -> list[str]:
    items = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if depth < 0 or depth > 1:
            raise ConfigError(f"SLURM node list {text!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ConfigError(f"SLURM node list {text!r}: unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, text: str) -> list[str]:
    match = _BRACKETS.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    names = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ConfigError(f"SLURM node list {text!r}: {part!r} is not a number or a range a-b")
        for number in range(int(low), int(high or low) + 1):
            names.extend(f"{head}{number:0{len(low)}d}{rest}" for rest in _expand_item(tail, text))
    return names


def tasks_on_node(text: str, node: int) -> int:
    """This node's tasks in ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 on each of the first
    three nodes, 1 on the fourth)."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE {text!r}: expected counts such as 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID {node} is not among the {len(counts)} nodes of SLURM_STEP_TASKS_PER_NODE")
    return counts[node]


def in_srun_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an ``srun`` step (the batch script's has no step id)."""
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def step_nodes(env: Mapping[str, str]) -> list[str]:
    """The hosts of this task's step, in order (its node list expanded)."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes:
        raise ConfigError("under srun, SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) must name the step's hosts")
    return expand_hostlist(nodes)


def under_srun(env: Mapping[str, str]) -> bool:
    """Whether this process is one task of several of an ``srun`` step (a step of one task,
    ``srun --pty bash`` say, starts its runs as any shell)."""
    if not in_srun_step(env):
        return False
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    return tasks.isdigit() and int(tasks) > 1


def job_port(number: int, span: tuple[int, int] | None) -> int:
    """The rendezvous port of a job and step (``number``: their ids' sum): in ``span`` (low,
    high) where given, else from PORT_BASE. Two runs started at once on one machine, each
    with a range of its own, never meet on one port, whatever their jobs' ids."""
    low, size = (span[0], span[1] - span[0] + 1) if span else (PORT_BASE, PORT_SPAN)
    return low + number % size


def slurm_place(env: Mapping[str, str]) -> dict[str, object]:
    """This task's place (``ClusterEnv``'s fields) from ``srun``'s variables."""
    try:
        rank, size = int(env["SLURM_PROCID"]), int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        step = int(env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0")))
        job = int(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0")))
        local = int(env.get("SLURM_LOCALID", "0"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        node = int(env.get("SLURM_NODEID", "0"))
        port = int(env.get("MASTER_PORT") or job_port(job + step, port_range(env)))
    except ValueError as error:
        raise ConfigError(f"bad SLURM environment variable: {error}") from None
    return {
        "rank": rank,
        "world_size": size,
        "local_rank": local,
        "master_addr": env.get("MASTER_ADDR") or step_nodes(env)[0],
        "master_port": port,
        "local_world_size": tasks_on_node(per_node, node) if per_node else 1,
    }
