"""Backup workers against stragglers, on a simulated cluster (Chen et al. 2016).

Simulates synchronous parameter-server training with and without K backup workers on
a cluster whose step times have a lognormal tail, then trains the digits MLP on the
simulated schedule of both (virtual-cluster training) and prints when each reaches
its accuracy, in simulated seconds.

    python examples/simulate_backup_workers.py [--workers 16] [--backup 2] [--sigma 0.5]
"""

import argparse

import torch

from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.simulate.cluster import Cluster, parse_straggler
from paratrain.simulate.simulator import simulate
from paratrain.simulate.virtual import replay

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--workers", type=int, default=16)
parser.add_argument("--backup", type=int, default=2)
parser.add_argument("--sigma", type=float, default=0.5)
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

digits = load_digits()
batch = 16
rounds = args.epochs * (len(digits.train) // (batch * args.workers))
cluster = Cluster(
    workers=args.workers,
    compute_s=0.05,
    model_bytes=10e6,
    bandwidth=10e9 / 8,
    latency=10e-6,
    ps_shards=4,
    straggler=parse_straggler(f"lognormal:{args.sigma}"),
)
for strategy, backup in (("ps-sync", 0), ("ps-backup", args.backup)):
    outcome = simulate(strategy, cluster, rounds, seed=0, record=True, backup=backup)
    summary = outcome.summary(batch)
    torch.manual_seed(0)
    model = build_model("mlp", digits.spec)
    result = replay(outcome, model, digits.train, digits.test, batch=batch, lr=0.05, momentum=0.9)
    print(
        f"{strategy:9s} K={backup}: {summary['step_seconds'] * 1e3:6.1f} ms/step, "
        f"{summary['examples_per_second']:7.0f} examples/s, dropped {summary['dropped_gradients']:4d}, "
        f"test accuracy {result['test_accuracy']:.4f} at {result['sim_seconds']:.2f} simulated s"
    )
