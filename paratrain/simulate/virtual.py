"""Virtual-cluster training: real training in one process on the schedule a simulation gives.

The simulator's trace says, for every update, whose gradients it applies, on which parameter version each
was computed, and when. The real model is trained in exactly that order, each gradient computed on the
version its worker pulled (a ring of past versions as deep as the trace's largest staleness), so accuracy
can be read against simulated wall time on a laptop. Batches are handed out in the order gradients are
applied (dynamic sharding, as the PS workers do); dropped gradients are not computed. The optimizer is the
run's, stepping the parameters as one flat vector where the real strategy steps it (server, every replica,
or per replica for local-sgd).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.registry import OPTIMIZERS
from paratrain.simulate.cluster import Cluster
from paratrain.simulate.simulator import Outcome, simulate


class BatchStream:
    """Index batches of size ``batch`` from a seeded permutation per epoch; each epoch's
    tail shorter than ``group`` batches is dropped."""

    def __init__(self, num_examples: int, batch: int, group: int, seed: int):
        self.n = num_examples
        self.batch = batch
        self.group = group
        self.seed = seed
        self.per_epoch = num_examples // (batch * group) * group
        self.taken = 0
        """Batches handed out so far."""
        self._iter = self._batches()

    def _batches(self) -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            for k in range(self.per_epoch):
                yield order[k * self.batch : (k + 1) * self.batch]
            epoch += 1

    def next(self) -> torch.Tensor:
        self.taken += 1
        return next(self._iter)

    def epochs_done(self) -> int:
        """Whole epochs handed out so far."""
        return self.taken // self.per_epoch if self.per_epoch else 0


class FlatOptimizer:
    """The run's optimizer (made as ``paratrain train`` makes it from ``config``: its
    ``optimizer``, ``lr``, ``momentum``, ``weight_decay``) over one flat parameter vector
    ``params``, which each step updates in place."""

    def __init__(self, params: torch.Tensor, config: TrainConfig):
        self.params, self.lr = params, config.lr
        self._param = nn.Parameter(params)  # shares params' storage: the steps update params
        self._optimizer = OPTIMIZERS.get(config.optimizer)([self._param], config)

    def step(self, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        """One update with ``grad``; ``lr_scale`` scales the rate of this one (a stale
        gradient's, --stale-policy scale-lr)."""
        for group in self._optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self._param.grad = grad
        self._optimizer.step()


class Replayer:
    def __init__(self, model: nn.Module, train: Any, test: Any, batch: int, group: int, seed: int):
        self.model = model
        self.inputs, self.targets = train.tensors
        self.test_inputs, self.test_targets = test.tensors
        self.stream = BatchStream(len(self.targets), batch, group, seed)
        self.loss_fn = nn.CrossEntropyLoss()
        self.params = [p for p in model.parameters() if p.requires_grad]

    def flat(self) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.params).detach().clone()

    def gradient(self, flat: torch.Tensor) -> torch.Tensor:
        """Gradient of the mean loss on the next batch, computed at parameters ``flat``."""
        torch.nn.utils.vector_to_parameters(flat, self.params)
        idx = self.stream.next()
        self.model.zero_grad(set_to_none=True)
        self.loss_fn(self.model(self.inputs[idx]), self.targets[idx]).backward()
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor) -> dict[str, float]:
        torch.nn.utils.vector_to_parameters(flat, self.params)
        logits = self.model(self.test_inputs)
        return {
            "test_accuracy": float((logits.argmax(1) == self.test_targets).float().mean()),
            "test_loss": float(self.loss_fn(logits, self.test_targets)),
        }


def replay(
    outcome: Outcome,
    model: nn.Module,
    train: Any,
    test: Any,
    *,
    batch: int,
    lr: float,
    momentum: float,
    optimizer: str = "sgd",
    weight_decay: float = 0.0,
    seed: int = 0,
    evals: int | None = 10,
) -> dict[str, Any]:
    """Train ``model`` on the trace of ``outcome`` with ``optimizer`` (a name of ``paratrain
    train``'s --optimizer); returns the final parameters, accuracy against simulated time,
    and the run's statistics. The history evaluates ``evals`` times, evenly over the trace,
    or (``evals=None``) after the update that ends each epoch of the data, where a real run
    evaluates: the time to a target a run reports is such an epoch's end."""
    config = TrainConfig(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay)
    trace = outcome.trace
    sync = outcome.strategy != "ps-async"
    rep = Replayer(model, train, test, batch, outcome.workers if sync else 1, seed)
    current = rep.flat()
    every = max(len(trace) // evals, 1) if evals else 0
    evaluated = 0  # with evals=None: the epochs ended at the last evaluation

    def due(i: int) -> bool:
        nonlocal evaluated
        if every:
            return (i + 1) % every == 0 or i == len(trace) - 1
        ended, evaluated = evaluated, rep.stream.epochs_done()
        return evaluated > ended

    history = []
    if outcome.strategy == "local-sgd":
        replicas = [FlatOptimizer(current.clone(), config) for _ in range(outcome.workers)]
        for i, update in enumerate(trace):
            for _ in range(outcome.period):
                for r in replicas:
                    r.step(rep.gradient(r.params))
            current = torch.stack([r.params for r in replicas]).mean(0)
            for r in replicas:  # averaging (Lin et al. 2020): parameters, not the optimizers' state
                r.params.copy_(current)
            if due(i):
                history.append({"updates": i + 1, "sim_seconds": update.time, **rep.evaluate(current)})
    else:
        opt = FlatOptimizer(current, config)
        # The ring of past versions: version v stays while a later update still needs it.
        needed_after = [0] * (len(trace) + 1)
        needed_after[-1] = len(trace)
        for i in range(len(trace) - 1, -1, -1):
            needed_after[i] = min(needed_after[i + 1], min(trace[i].versions))
        versions = {0: current.clone()}
        for i, update in enumerate(trace):
            grads = [rep.gradient(versions[v]) for v in update.versions]
            # Averaged as the server (or the all-reduce) does: sum, then divide by N.
            opt.step(torch.stack(grads).sum(0) / len(grads), update.lr_scale)
            versions[i + 1] = current.clone()
            for v in [v for v in versions if v < needed_after[i + 1]]:
                del versions[v]
            if due(i):
                history.append({"updates": i + 1, "sim_seconds": update.time, **rep.evaluate(current)})
    final = history[-1] if history else {"sim_seconds": 0.0, **rep.evaluate(current)}
    torch.nn.utils.vector_to_parameters(current, rep.params)
    summary = outcome.summary(batch)
    return {
        "strategy": outcome.strategy,
        "workers": outcome.workers,
        "updates": len(trace),
        "sim_seconds": final["sim_seconds"],
        "test_accuracy": final["test_accuracy"],
        "test_loss": final["test_loss"],
        "dropped_gradients": outcome.dropped,
        "staleness": summary["staleness"],
        "history": history,
        "params": current,
    }


def train_virtual(
    args: argparse.Namespace,
    strategy: str,
    cluster: Cluster,
    model: nn.Module,
    splits: Any,
    options: dict[str, Any],
) -> dict[str, Any]:
    """``paratrain simulate --train``: simulate enough steps for ``--epochs``, then replay."""
    n = cluster.workers
    steps = max(args.epochs * (len(splits.train) // (args.batch_size * n)), 1)
    outcome = simulate(strategy, cluster, steps, seed=args.seed, record=True, **options)
    result = replay(
        outcome,
        model,
        splits.train,
        splits.test,
        batch=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        seed=args.seed,
    )
    result.pop("params")
    return result
