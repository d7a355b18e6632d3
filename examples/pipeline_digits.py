"""Pipeline parallelism on the digits data: one model's layers in stages, micro-batches
flowing through them.

The model (a plain ``nn.Sequential``) is cut into S consecutive stages, one per process.
Each batch is cut into M micro-batches: while stage 1 works on micro-batch 1, stage 0
already computes micro-batch 2, so the stages idle only at the start and the end of a
step, a share (S-1)/(M+S-1) of it (GPipe, Huang et al. 2019). GPipe runs all forwards,
then all backwards, and keeps every micro-batch's activations until the backwards;
1F1B (PipeDream-Flush, Narayanan et al. 2021) alternates one forward and one backward,
so a stage keeps at most S of them. The gradients are those of the whole batch.

    python examples/pipeline_digits.py                                 # 2 stages, 4 micro-batches, 1F1B
    python examples/pipeline_digits.py --stages 3 --microbatches 8 --schedule gpipe
    python examples/pipeline_digits.py --model cifar_cnn --lr 0.02 --epochs 10
    python examples/pipeline_digits.py --workers 4                     # 2 pipelines of 2 stages
    torchrun --nproc-per-node 2 examples/pipeline_digits.py

The digits data ships with scikit-learn: no download.
"""

from __future__ import annotations

import argparse
import sys

import torch

import paratrain
from paratrain.comm.transport import cluster_from_env
from paratrain.data.datasets import load_digits
from paratrain.launch.cli import report_errors
from paratrain.models import build_model


def train(args: argparse.Namespace) -> dict[str, float]:
    """One stage's part of the run (every process runs this)."""
    strategy = paratrain.PipelineStrategy(
        num_stages=args.stages, num_microbatches=args.microbatches, schedule=args.schedule, device=args.device
    )
    data = load_digits()
    with strategy.scope():
        # Every process builds the whole model with the same seed, hence the same weights;
        # the Trainer's strategy.prepare keeps this process's stage and its parameters.
        torch.manual_seed(args.seed)
        model = build_model(args.model, data.spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        trainer = paratrain.Trainer(model, "cross_entropy", optimizer, metrics=["accuracy"])
    start, stop = strategy.bounds[strategy.stage]
    layers = ", ".join(type(layer).__name__ for layer in trainer.module)
    print(f"stage {strategy.stage} of replica {strategy.rank}: layers {start}-{stop - 1} ({layers})", flush=True)
    if strategy.is_chief:  # the last stage of replica 0: it holds the loss and the logits
        print(
            f"{strategy.num_replicas} pipeline(s) x {args.stages} stages, {args.schedule}, "
            f"batch {args.batch_size} in {args.microbatches} micro-batches of {args.batch_size // args.microbatches}"
        )
    trainer.fit(data.train, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, verbose=1)
    results = trainer.evaluate(data.test)  # every stage runs its part of the forward pass
    if strategy.is_chief:
        print(f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}")
    strategy.teardown()
    return results


def run(args: argparse.Namespace) -> None:
    if args.batch_size % args.microbatches:
        raise paratrain.ConfigError(
            f"--batch-size {args.batch_size} must be a multiple of --microbatches {args.microbatches} "
            "(every micro-batch has the same size)"
        )
    if cluster_from_env() is None:
        paratrain.launch(train, args, num_processes=args.workers or args.stages)  # processes on this machine
    else:
        train(args)  # one rank of a torchrun cluster


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "cifar_cnn"))
    parser.add_argument("--stages", type=int, default=2, help="stages, one process each (default 2)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (default 4)")
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes, a multiple of --stages: workers / stages pipelines (default: --stages)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="examples per pipeline per step")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(report_errors(run, parse(), prog="pipeline_digits"))
