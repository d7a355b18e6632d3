"""CIFAR-10 on several GPUs (or CPU processes): TensorFlow's cifar10_multi_gpu_train recipe.

What the recipe does, and what does it here:

| recipe (cifar10_multi_gpu_train.py)                     | here                                    |
| ------------------------------------------------------- | --------------------------------------- |
| one tower per GPU, batch 128 each, gradients averaged   | AllReduceStrategy, --batch-size 128 per replica |
| cifar10.inference; weight decay 0.004 on local3, local4 | model cifar_cnn; SGD weight_decay on those two layers |
| distorted_inputs: crop 24x24, flip, brightness, contrast, standardization | data set cifar10's training transform |
| GradientDescent, lr 0.1 x 0.1 every 350 epochs, staircase | SGD + ExponentialDecay(staircase=True)  |
| step log every 10 steps: examples/sec, sec/batch         | Trainer's step log (log_every=10)       |
| Saver every 1000 steps and at the last step              | Checkpoint(train_dir, every_steps=1000) |
| assert not np.isnan(loss_value), 'Model diverged...'     | DivergedError: exit code 3, step named  |
| max_steps 1,000,000                                      | --max-steps                             |

    python examples/cifar10_multi_gpu.py                       # all local GPUs (or 1 CPU process)
    python examples/cifar10_multi_gpu.py --workers 4 --device cpu --max-steps 5000

The binary version of CIFAR-10 (170 MB) is downloaded to ~/.cache/paratrain/cifar10
on first use; --data-dir reads it (cifar-10-batches-bin/) from elsewhere.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn

import paratrain
from paratrain.comm.transport import cluster_from_env
from paratrain.data.datasets import load_dataset
from paratrain.launch.cli import report_errors
from paratrain.models import build_model
from paratrain.train.callbacks import Callback

# The constants of cifar10.py.
INITIAL_LEARNING_RATE = 0.1
NUM_EPOCHS_PER_DECAY = 350.0
LEARNING_RATE_DECAY_FACTOR = 0.1
WEIGHT_DECAY = 0.004


class StopAtStep(Callback):
    """Ends training after ``max_steps`` global steps (the recipe counts steps, not epochs)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def on_batch_end(self, step: int, logs: dict) -> None:
        if step >= self.max_steps:
            self.trainer.stop_training = True


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Plain gradient descent; L2 weight decay 0.004 on the weights of the two hidden dense
    layers only, as cifar10.inference adds ``wd * l2_loss(weights)`` for local3 and local4."""
    dense = [m for m in model.modules() if isinstance(m, nn.Linear)]
    decayed = [layer.weight for layer in dense[:2]]
    rest = [p for p in model.parameters() if all(p is not d for d in decayed)]
    return torch.optim.SGD(
        [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )


def train(args: argparse.Namespace) -> dict[str, float]:
    """One tower's part of the run (every process runs this)."""
    strategy = paratrain.MirroredStrategy(device=args.device)
    data = load_dataset("cifar10", data_dir=args.data_dir, download=args.download)
    with strategy.scope():
        torch.manual_seed(args.seed)
        model = build_model("cifar_cnn", data.spec)
        trainer = paratrain.Trainer(model, "cross_entropy", make_optimizer(model, args.lr))
    # As in the recipe, an "epoch" of decay counts batches of one tower (batch_size, not
    # batch_size x towers): with N towers the rate drops every 350 x N passes over the data.
    num_batches_per_epoch = len(data.train) / args.batch_size
    decay_steps = max(int(num_batches_per_epoch * NUM_EPOCHS_PER_DECAY), 1)
    schedule = paratrain.ExponentialDecay(args.lr, decay_steps, LEARNING_RATE_DECAY_FACTOR, staircase=True)
    steps_per_epoch = len(data.train) // (args.batch_size * strategy.num_replicas)
    epochs = math.ceil(args.max_steps / max(steps_per_epoch, 1))
    if strategy.is_chief:
        print(
            f"{strategy.num_replicas} tower(s) x batch {args.batch_size}, {args.max_steps} steps "
            f"({epochs} epochs of {steps_per_epoch} steps), learning rate {args.lr} x "
            f"{LEARNING_RATE_DECAY_FACTOR} every {decay_steps} steps"
        )
    trainer.fit(
        data.train,
        epochs=epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        log_every=args.log_every,
        callbacks=[
            paratrain.LearningRateScheduler(schedule),
            StopAtStep(args.max_steps),
            paratrain.Checkpoint(args.train_dir, every_steps=args.checkpoint_every),
        ],
    )
    # cifar10_eval.py: the test set's central crops, precision @ 1.
    results = trainer.evaluate(data.test)
    if strategy.is_chief:
        print(f"step {trainer.global_step}: precision @ 1 = {results['accuracy']:.3f}")
        print(f"checkpoints in {args.train_dir}")
    strategy.teardown()
    return results


def run(args: argparse.Namespace) -> None:
    if cluster_from_env() is None and args.workers > 1:
        paratrain.launch(train, args, num_processes=args.workers)  # one process per tower
    else:
        train(args)  # one process, or one rank of a torchrun cluster


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="folder of cifar-10-batches-bin (default ~/.cache/paratrain/cifar10)")
    parser.add_argument(
        "--download",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="download the binary version when absent (default yes)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=max(torch.cuda.device_count(), 1),
        help="towers (processes; default: one per local GPU, else 1)",
    )
    parser.add_argument("--batch-size", type=int, default=128, help="examples per tower per step")
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument("--lr", type=float, default=INITIAL_LEARNING_RATE)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--train-dir", default="/tmp/cifar10_train", help="where checkpoints go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(report_errors(run, parse(), prog="cifar10_multi_gpu"))
