"""``paratrain train``: start a run's processes here, join a cluster started elsewhere
(torchrun, TF_CONFIG), or join a running parameter-server run (``--join``)."""

from __future__ import annotations

import argparse
from typing import Any

from paratrain.checkpoints.store import CheckpointStore
from paratrain.comm.transport import cluster_from_env
from paratrain.console import console
from paratrain.data.datasets import load_dataset
from paratrain.errors import ConfigError
from paratrain.launch.flags import add_train_arguments, train_config
from paratrain.launch.local import run_locally
from paratrain.launch.per_node import per_node_command
from paratrain.launch.process import exit_now, start_server
from paratrain.models import build_model
from paratrain.registry import STRATEGIES
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.fault_tolerant.config import FTConfig
from paratrain.strategies.ps.joining import read_run
from paratrain.train import job
from paratrain.train.preemption import EXIT_STOPPED

EPILOG = (
    "--batch-size is per replica: the global batch is batch-size x workers. "
    "Under torchrun (or with TF_CONFIG set) the command joins that cluster instead of "
    "starting processes itself."
)


def add_parser(commands: Any) -> None:
    train = commands.add_parser("train", help="train a model", description="Train a model.", epilog=EPILOG)
    add_train_arguments(train)
    train.add_argument(
        "--procs-per-node",
        type=int,
        metavar="N",
        help="under srun with one task per node: start N processes on each node (as torchrun does); the step's "
        "nodes make one run",
    )
    train.set_defaults(handler=train_command)


def train_command(args: argparse.Namespace) -> int:
    if args.join:
        return join_command(args)
    if args.procs_per_node is not None:
        return per_node_command(args.argv, args.procs_per_node)
    cluster = cluster_from_env()
    config = train_config(args, cluster)
    topology = config.topology
    if cluster is not None:  # joined a cluster started elsewhere: this process is one rank of it
        topology.check_cluster(cluster, config.strategy)
        metrics = job.run(config)
        is_chief = "global_steps" in metrics  # the process that wrote the run's document
    else:
        if config.checkpoint_dir and not config.resume:  # before any process of the run could save
            CheckpointStore(config.checkpoint_dir).refuse_to_start_over()
        if topology.num_processes > 1 or config.max_restarts:
            start_server()
            preflight(config)
        metrics = run_locally(config)
        is_chief = True
    if is_chief:
        print_summary(metrics, config.metrics_out)
    stopped = metrics.get("stopped")
    if stopped:  # at a signal (preemption.py): every process of the run says so in its exit code
        if is_chief:
            console.print(
                f"paratrain: stopped after step {stopped['step']} on {stopped['signal']}; its checkpoint is in "
                f"{config.checkpoint_dir}: run the same command with --resume to go on"
            )
        return EXIT_STOPPED
    if cluster is not None and config.strategy in FTConfig.strategies:
        # A fault-tolerant replica under torchrun keeps the quorum groups of its run, some
        # with a collective abandoned on a vanished peer whose Gloo thread never ends:
        # dropping such a group joins that thread, keeping it to the interpreter's end
        # aborts the process after the run succeeded (docs/failures.md, A clean exit).
        # Its output written, it ends here, as the local launcher's replicas do.
        exit_now(0)
    return 0


def join_command(args: argparse.Namespace) -> int:
    """One more worker for the running ps-async or ps-backup run at ``--join``: this process
    is it. It takes the run's options (the flags given here override them)."""
    if args.strategy:  # the flags given make sense on their own (--join with its mode) before any wait
        train_config(args, None)
    _, run = read_run(args.join, args.timeout or DEFAULT_TIMEOUT_S)
    if run.get("options") is None and not args.config:
        raise ConfigError(
            f"--join {args.join}: the run there publishes no options (started from Python): give --config"
        )
    config = train_config(args, None, base=run.get("options"))
    mine = job.run(config)
    console.print(
        f"done: worker {mine['rank']} took {mine['steps']} steps ({mine['examples']} examples) in the run at "
        f"{args.join}; its chief writes the run's results"
    )
    return 0


def preflight(config: Any) -> None:
    """Catch bad data, a model that does not fit it, or a model the strategy cannot run as
    configured, here, before starting N processes."""
    spec = load_dataset(config).spec
    model = build_model(config.model, spec, options=config.model_options, lazy_tables=config.ps.holds_tables)
    STRATEGIES.get(config.strategy).check_model(model, config)


def print_summary(metrics: dict[str, Any], metrics_out: str | None) -> None:
    scores = [f"{key} {value:.4f}" for key, value in metrics.items() if key.startswith("test_") and value is not None]
    console.print(
        f"done: {', '.join(scores)}, "
        f"{metrics['global_steps']} steps in {metrics['wall_seconds']:.1f} s, "
        f"{metrics['examples_per_second']:.0f} examples/sec "
        f"({metrics['strategy']}, {metrics['workers']} worker{'s' if metrics['workers'] != 1 else ''})"
    )
    if metrics_out:
        console.print(f"metrics written to {metrics_out}")
