"""``paratrain slurm``: a complete sbatch script for a run, printed or submitted.

``paratrain slurm --nodes 2 --tasks-per-node 4 --time 02:00:00 -- --strategy allreduce
--checkpoint-dir ck`` prints a batch script that runs ``srun paratrain train ...`` with one
task per process (comm/slurm.py: the tasks form one run). With ``--checkpoint-dir`` among the
run's flags the script asks SLURM for its time-limit warning (``--signal=USR1@SECONDS``, to
the tasks), resumes from the newest checkpoint (``--resume``), and with ``--requeue`` puts the
job back in the queue when the run stopped at a signal (exit 75: train/preemption.py), so a
long run goes on over several allocations. The run's flags are checked here, against the
allocation's size, as the tasks will check them. ``--submit`` hands the script to sbatch.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from typing import Any

from paratrain.comm.transport import ClusterEnv
from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.launch.flags import parse_train_config
from paratrain.train.preemption import EXIT_STOPPED

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


def add_parser(commands: Any) -> None:
    slurm = commands.add_parser(
        "slurm",
        help="an sbatch script for a run (printed, or submitted with --submit)",
        description="A complete SLURM batch script that runs `srun paratrain train ...`, one task per process; "
        "the run's flags follow `--`.",
    )
    slurm.add_argument("--nodes", type=int, default=1, help="nodes of the allocation (default 1)")
    slurm.add_argument("--tasks-per-node", type=int, default=1, help="processes of the run on each node (default 1)")
    slurm.add_argument("--gpus-per-task", type=int, default=0, help="GPUs each process takes (default 0: none)")
    slurm.add_argument("--cpus-per-task", type=int, default=0, help="cores each process takes (default: SLURM's)")
    slurm.add_argument("--time", default="01:00:00", help="the job's time limit, [D-]HH:MM:SS (default 01:00:00)")
    slurm.add_argument("--job-name", default="paratrain", help="the job's name (default paratrain)")
    slurm.add_argument("--partition", help="the partition to run in (default: SLURM's)")
    slurm.add_argument("--account", help="the account to charge (default: SLURM's)")
    slurm.add_argument(
        "--warn-seconds", type=int, default=90, help="with --checkpoint-dir: SIGUSR1 this long before the time limit"
    )
    slurm.add_argument(
        "--requeue", action="store_true", help="with --checkpoint-dir: requeue the job when the run stopped at a signal"
    )
    slurm.add_argument("--submit", action="store_true", help="hand the script to sbatch instead of printing it")
    slurm.add_argument("train", nargs=argparse.REMAINDER, help="-- then the flags of paratrain train")
    slurm.set_defaults(handler=slurm_command)


def batch_script(args: argparse.Namespace) -> str:
    """The script for ``args`` (their ``train``: the run's flags); ConfigError for what the
    allocation cannot run."""
    for name in ("nodes", "tasks_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not _TIME.match(args.time):
        raise ConfigError(f"--time must be [D-]HH:MM:SS (SLURM's form), got {args.time!r}")
    flags = args.train[1:] if args.train[:1] == ["--"] else list(args.train)
    run = _run_flags(flags, args.nodes * args.tasks_per_node)
    checkpoints = run.checkpoint_dir is not None
    if args.requeue and not checkpoints:
        raise ConfigError("--requeue goes on from checkpoints: give the run a --checkpoint-dir after --")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.tasks_per_node}",
        f"#SBATCH --time={args.time}",
        "#SBATCH --output=%x-%j.out",
    ]
    lines += [
        f"#SBATCH --{name}={value}"
        for name, value in (
            ("gpus-per-task", args.gpus_per_task),
            ("cpus-per-task", args.cpus_per_task),
            ("partition", args.partition),
            ("account", args.account),
        )
        if value
    ]
    if checkpoints:
        lines += [f"#SBATCH --signal=USR1@{args.warn_seconds}", *(["#SBATCH --requeue"] if args.requeue else [])]
    train = ["srun", "paratrain", "train", *flags, *(["--resume"] if checkpoints and not run.resume else [])]
    lines += [
        "",
        "# One task per process: the tasks form one run (paratrain reads srun's variables).",
        shlex.join(train),
        "code=$?",
    ]
    if args.requeue:
        lines += [
            f"if [ $code -eq {EXIT_STOPPED} ]; then  # stopped at the time-limit warning, with a checkpoint",
            '    scontrol requeue "$SLURM_JOB_ID" && exit 0  # runs again, from that checkpoint',
            "fi",
        ]
    return "\n".join([*lines, "exit $code", ""])


def _run_flags(flags: list[str], processes: int) -> Any:
    """The run's TrainConfig from its flags, checked against ``processes`` tasks."""
    cluster = ClusterEnv(rank=0, world_size=processes, local_rank=0, master_addr="", master_port=0, source="slurm")
    config = parse_train_config(flags, cluster)
    config.topology.check_cluster(cluster, config.strategy)
    return config


def slurm_command(args: argparse.Namespace) -> int:
    script = batch_script(args)
    if not args.submit:
        print(script, end="")
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("--submit hands the script to sbatch, which is not on PATH (print it without --submit)")
    result = subprocess.run([sbatch], input=script, text=True, capture_output=True)
    if result.returncode:
        raise ConfigError(f"sbatch refused the script: {result.stderr.strip().splitlines()[-1]}")
    console.print(result.stdout.strip())
    return 0
