"""The one reduction of a fault-tolerant step: a participant's gradient and loss, weighted
by its share of the global batch, summed over the step's quorum in one flat all-reduce
that never raises (a peer lost during it leaves the step uncommitted: torchft's Manager
records the error and ``should_commit`` says no)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.comm.flat import flat_gradients, write_gradients
from paratrain.errors import WorkerLost
from paratrain.strategies.fault_tolerant.membership import Membership
from paratrain.strategies.fault_tolerant.replicas import batch_mark
from paratrain.timeline import span


def sum_over_quorum(
    membership: Membership,
    params: list[nn.Parameter],
    loss: torch.Tensor,
    share: float,
    wire_dtype: torch.dtype | None,
    step: int,
    targets: Any,
    worker: int,
) -> torch.Tensor:
    """Sum the gradients of ``params`` and ``loss``, each weighted by ``share``, over the
    quorum of ``membership``, in place (in ``wire_dtype`` on the wire: None for the parameters'
    own); returns the summed loss. WorkerLost when the participants' batches of ``step``
    differ (``worker`` names this one)."""
    grads = flat_gradients(params)
    # Every participant must hold the same step's same global batch: their marks then sum
    # to P times each one's (exact in float32, as the loss must be: never in 16 bits).
    mark = batch_mark(step, targets)
    tail = torch.stack(
        [loss.detach().to(grads.device, torch.float32) * share, torch.tensor(float(mark), device=grads.device)]
    )
    with span("allreduce"):
        if wire_dtype is None:  # one all-reduce: gradient, loss and mark
            flat = torch.cat([grads.mul_(share), tail.to(grads.dtype)])
            membership.sum([flat], step)
            grads, tail = flat[:-2], flat[-2:]
        else:  # the gradient in 16 bits (scaled first: a share is never below 1/P)
            wire = grads.mul_(share).to(wire_dtype)
            membership.sum([wire, tail], step)
            grads = wire.to(grads.dtype)
    manager = membership.manager
    if manager.errored() is None and int(tail[1]) != mark * manager.num_participants():
        raise WorkerLost(
            f"worker {worker}: the replicas disagree on the global batch of step {step} (a position was not carried over)"
        )
    write_gradients(params, grads)
    return tail[0].detach().clone()
