"""The flags of ``paratrain simulate`` (cli.py checks and runs them). Nothing heavy is
imported here: the parser is built on every ``paratrain`` call."""

from __future__ import annotations

import argparse

from paratrain.registry import OPTIMIZERS

DEFAULT_WORKERS = "1,2,4,8,16,32,64,128,256,512,1024"


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain simulate``."""
    a = p.add_argument
    a(
        "--strategy",
        default="allreduce",
        help="allreduce, ps-sync, ps-backup, ps-async, local-sgd, diloco, fsdp, tensor, pipeline, or several "
        "comma-separated (default allreduce)",
    )
    a(
        "--workers",
        default=DEFAULT_WORKERS,
        help=f"worker counts to simulate, comma-separated (default {DEFAULT_WORKERS}); with --train, one count",
    )
    a(
        "--steps",
        type=int,
        default=200,
        help="global steps per run (ps-async: the same number of pushes, steps x workers) (default 200)",
    )
    a(
        "--compute-ms",
        type=float,
        default=None,
        help="milliseconds of forward+backward per local batch (default: measured, as --profile)",
    )
    a(
        "--profile",
        action="store_true",
        help="measure the compute time: a few real forward/backward steps of --model on --dataset here",
    )
    a("--model", default="mlp", help="model whose size (and, with --profile or --train, compute) is used (default mlp)")
    a("--dataset", default="digits", help="data set for --profile and --train (default digits)")
    a("--batch-size", type=int, default=32, help="examples per worker per step (default 32)")
    a("--model-mb", type=float, default=None, help="gradient size in MB (10^6 bytes), instead of --model's own")
    a(
        "--bandwidth-gbps",
        type=float,
        default=10.0,
        help="every node's link, Gb/s each way; inf for an ideal network (default 10)",
    )
    a("--latency-us", type=float, default=10.0, help="microseconds per message on a link (default 10)")
    a(
        "--ring-latency-us",
        type=float,
        default=None,
        help="microseconds per ring all-reduce step (default: the calibration's, else --latency-us)",
    )
    a("--ps-shards", type=int, default=1, help="parameter-server shards P (ps-*) (default 1)")
    a(
        "--backup-workers",
        type=int,
        default=0,
        help="ps-backup: spare workers K whose late gradients are dropped (default 0)",
    )
    a(
        "--staleness-bound",
        type=int,
        default=None,
        help="ps-async: a worker more than S steps ahead of the slowest waits",
    )
    a(
        "--stale-policy",
        default="none",
        choices=("none", "scale-lr", "drop"),
        help="ps-async: stale-gradient policy (default none)",
    )
    a(
        "--max-staleness",
        type=int,
        default=4,
        help="ps-async with --stale-policy drop: largest staleness applied (default 4)",
    )
    a(
        "--sync-every",
        "--period",
        dest="period",
        type=int,
        default=8,
        help="local-sgd, diloco: local steps H between synchronizations, as paratrain train's --sync-every (default 8)",
    )
    a("--fragments", type=int, default=1, help="local-sgd, diloco: fragments synchronized in turn (default 1)")
    a(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsdp: gather the parameters again for the backward pass (default: yes, ZeRO-3)",
    )
    a("--fsdp-units", type=int, default=4, help="fsdp: units, one all-gather each per pass (default 4)")
    a(
        "--tensor-parallel",
        default=None,
        help="tensor, pipeline: processes T each layer is split over, comma-separated to compare meshes (W/T "
        "replicas of T at each --workers W; pipeline: of S x T) (default: tensor 2, pipeline 1)",
    )
    a(
        "--stages",
        default=None,
        help="pipeline: stages S the model is cut into as train cuts it, comma-separated to compare (default 2)",
    )
    a("--microbatches", type=int, default=None, help="pipeline: micro-batches per batch (default 4)")
    a("--split-points", default=None, help="pipeline: where stages start, as paratrain train --split-points")
    a(
        "--shard-replicas",
        action="store_true",
        help="tensor: the replicas shard their parts by FSDP2 instead of all-reducing them (2-D)",
    )
    a(
        "--tp-bandwidth-gbps",
        type=float,
        default=None,
        help="tensor, pipeline: the link between the T processes of a replica, Gb/s each way (one machine's: NVLink, PCIe) "
        "(default --bandwidth-gbps)",
    )
    a(
        "--tp-latency-us",
        type=float,
        default=None,
        help="tensor, pipeline: microseconds per ring step of a collective among T processes (default: the calibration's host "
        "step, else --ring-latency-us, else --latency-us)",
    )
    a(
        "--tp-module-us",
        type=float,
        default=None,
        help="tensor, pipeline: microseconds each split module adds to a step beyond its collectives' bytes (DTensor's "
        "dispatch, the collectives' own work) (default: the calibration's, else 0)",
    )
    a(
        "--loss-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tensor: the cross-entropy on the logits split by vocabulary, not gathered (default: yes, as train)",
    )
    a(
        "--tp-plan",
        default=None,
        help="tensor, pipeline: how to split --model, as paratrain train --tp-plan (default its own)",
    )
    a("--compression", default="none", help="gradient codec: none, fp16, bf16, int8, topk, powersgd (default none)")
    a("--topk-ratio", type=float, default=0.01, help="topk: share of gradient entries sent (default 0.01)")
    a("--powersgd-rank", type=int, default=4, help="powersgd: rank of the low-rank factors (default 4)")
    a(
        "--straggler",
        default="none",
        help="none, lognormal:SIGMA, fixed:WORKER:FACTOR, or sleep:WORKER:FACTOR (as paratrain train --straggler) (default none)",
    )
    a(
        "--host-cores",
        type=float,
        default=None,
        help="every process on one host of this many cores, shared (default: a machine per node)",
    )
    a(
        "--host-speedup",
        default=None,
        help="with --host-cores: measured throughput of 1, 2, ... processes computing at once, relative to one, e.g. 1,1.6,1.5,1.2",
    )
    a(
        "--cpu-share",
        type=float,
        default=None,
        help="every node limited to this share of one core by a CPU quota, as a Kubernetes CPU limit or "
        "paratrain cluster --cpu (default: whole cores)",
    )
    a("--cpu-period-ms", type=float, default=100.0, help="with --cpu-share: the quota's period (default 100)")
    a(
        "--message-cpu-us",
        type=float,
        default=None,
        help="with --cpu-share: CPU microseconds a node spends on each message it receives (default: the "
        "calibration's, else 0)",
    )
    a(
        "--ring-fixed-cpu-us",
        type=float,
        default=None,
        help="with --cpu-share: CPU microseconds a node spends once per ring all-reduce beyond its hops' (the "
        "framework's launch and finish) (default: the calibration's, else 0)",
    )
    a(
        "--ps-worker-cpu-us",
        type=float,
        default=None,
        help="with --cpu-share, ps-*: CPU microseconds a worker spends on a push and its reply (default: the "
        "calibration's, else --message-cpu-us)",
    )
    a(
        "--ps-message-us",
        type=float,
        default=None,
        help="ps-*: microseconds a shard works on each push (default: the calibration's, else 0)",
    )
    a(
        "--ps-update-us",
        type=float,
        default=None,
        help="ps-*: microseconds a shard works on each update (default: the calibration's, else 0)",
    )
    a(
        "--epoch-end-ms",
        type=float,
        default=None,
        help="milliseconds an epoch's end costs one process at a full core: the test split's evaluation and the next "
        "epoch's start; replicas share the evaluation, a parameter server's chief does it all (default: the "
        "calibration's, else 0)",
    )
    a(
        "--collective-us",
        type=float,
        default=None,
        help="microseconds a step of an all-reduce of a few values costs beyond --latency-us, as an epoch's end "
        "makes two (default: the calibration's, else 0)",
    )
    a(
        "--calibrate",
        metavar="FILE.json",
        default=None,
        help="measure here what the cost model needs for --model (compute, a message's CPU, a shard's work, a ring "
        "step, the codec), write it to FILE.json, and predict with it",
    )
    a(
        "--across-hosts",
        action="store_true",
        help="with --calibrate: the runs that measure messages (allreduce, ps-sync) run between two emulated hosts "
        "(paratrain cluster: network namespaces on a bridge, a core each; root) instead of over loopback",
    )
    a(
        "--calibrate-rounds",
        type=int,
        default=None,
        metavar="N",
        help="with --calibrate: rounds of the measuring runs, each cost the median over them (default 3: a shared "
        "machine's speed drifts between runs; 1 on a quiet machine takes a third of the time)",
    )
    a(
        "--calibration",
        metavar="FILE.json",
        default=None,
        help="predict with the costs measured by --calibrate (a flag given still wins)",
    )
    a("--failure-rate", type=float, default=0.0, help="failures per worker per hour (default 0)")
    a(
        "--recovery-s",
        type=float,
        default=60.0,
        help="seconds a failed worker needs before it computes again (default 60)",
    )
    a(
        "--seed",
        type=int,
        default=0,
        help="random seed: stragglers, failures, and with --train the model and data order (default 0)",
    )
    a("--json-out", metavar="FILE.json", default=None, help="write the results as one JSON object")
    a(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="plot throughput and scaling efficiency (with --train: accuracy against simulated time)",
    )
    a(
        "--train",
        action="store_true",
        help="virtual-cluster training: real training in this process, in the order and with the staleness the simulation gives",
    )
    a("--epochs", type=int, default=5, help="--train, --target-*: passes over the training data (default 5)")
    a(
        "--target-accuracy",
        type=float,
        default=None,
        help="rank the strategies by simulated time until the model reaches this test accuracy, each trained on "
        "its simulated schedule (as --train); one --workers count",
    )
    a("--target-loss", type=float, default=None, help="as --target-accuracy, to this test loss")
    a("--seeds", type=int, default=3, help="--target-*: seeds per strategy, from --seed on (default 3)")
    a(
        "--recommend",
        action="store_true",
        help="rank the strategies and their key options on the hosts that --hosts, --cpu, --link and --host "
        "describe (as paratrain cluster run takes them); with --target-*, by time to the target too",
    )
    a("--hosts", type=int, default=None, help="--recommend: the cluster's hosts")
    a("--cpu", type=float, default=1.0, help="--recommend: cores' worth of CPU per host (default 1.0)")
    a("--link", default=None, help="--recommend: each host's link rate, tc units: 1gbit, 100mbit")
    a(
        "--host",
        action="append",
        default=[],
        metavar="I:cpu=X[,calibration=FILE]",
        help="--recommend: one host's own CPU share, e.g. 3:cpu=0.15 (a slow host), or its own calibration "
        "measured on that machine, e.g. 3:calibration=old.json (its compute against --calibration's)",
    )
    a("--lr", type=float, default=0.05, help="--train and --calibrate's measuring runs: learning rate (default 0.05)")
    a(
        "--momentum",
        type=float,
        default=0.9,
        help="--train and --calibrate's measuring runs: SGD momentum (default 0.9)",
    )
    a(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZERS.names(with_aliases=False),
        help="--train and --calibrate's measuring runs: the optimizer, as paratrain train's (default sgd)",
    )
    a(
        "--weight-decay",
        type=float,
        default=0.0,
        help="--train and --calibrate's measuring runs: weight decay, as paratrain train's (default 0)",
    )


def has_target(args: argparse.Namespace) -> bool:
    """Whether ``--target-accuracy`` or ``--target-loss`` was given."""
    return args.target_accuracy is not None or args.target_loss is not None
