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
    grads, loss_sum = sum_weighted(membership, grads, loss.detach(), share, mark, wire_dtype, step)
    if loss_sum is None:
        raise WorkerLost(
            f"worker {worker}: the replicas disagree on the global batch of step {step} (a position was not carried over)"
        )
    write_gradients(params, grads)
    return loss_sum


def sum_weighted(
    membership: Membership,
    flat: torch.Tensor,
    scalar: torch.Tensor,
    weight: float,
    mark: int,
    wire_dtype: torch.dtype | None,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flat`` and ``scalar``, each times ``weight``, summed over the quorum of ``membership``
    (``flat`` in ``wire_dtype`` on the wire: None for its own), with the participants'
    ``mark`` (a 16-bit fingerprint of what each holds). The sums; the second None where the
    marks differ (participants at different steps or batches). ``flat`` is taken over."""
    tail = torch.stack([scalar.to(flat.device, torch.float32) * weight, torch.tensor(float(mark), device=flat.device)])
    with span("allreduce"):
        if wire_dtype is None:  # one all-reduce: the tensor, the scalar and the mark
            whole = torch.cat([flat.mul_(weight), tail.to(flat.dtype)])
            membership.sum([whole], step)
            flat, tail = whole[:-2], whole[-2:]
        else:  # the tensor in 16 bits (weighted first: a weight is at most 1)
            wire = flat.mul_(weight).to(wire_dtype)
            membership.sum([wire, tail], step)
            flat = wire.to(flat.dtype)
    manager = membership.manager
    if manager.errored() is None and int(tail[1]) != mark * manager.num_participants():
        return flat, None
    return flat, tail[0].detach().clone()
