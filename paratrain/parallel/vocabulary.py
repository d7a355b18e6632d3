"""Logits split by vocabulary, and the cross-entropy computed on them (Megatron-LM's and torchtitan's "loss
parallel").

Gathering a language model's logits whole is an all-gather of its largest activation and memory for all of
it on every process. Inside ``split_logits()`` the output layer (``colwise_rep``) gives its vocabulary slice as
a DTensor sharded on its last dimension, and ``F.cross_entropy`` runs under torch's ``loss_parallel()``: three
all-reduces of one value a position forward, nothing sent backward. The loss is a replicated DTensor;
``local`` makes it a plain tensor for the loop. Outside the context (metrics, ``predict``, another loss, the
user's own loop) the output layer gathers its logits whole.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

_SPLIT: ContextVar[bool] = ContextVar("paratrain_split_logits", default=False)

#: Bytes of each value the loss's all-reduces carry: loss_parallel computes the maximum and
#: the sum of exponentials in float32 whatever the logits' precision.
LOSS_VALUE_BYTES = 4

#: All-reduces of one value a position that the cross-entropy of split logits costs forward
#: (the maximum, the sum of exponentials, the target's logit); its backward pass sends nothing.
LOSS_ALL_REDUCES = 3


@contextlib.contextmanager
def split_logits() -> Iterator[None]:
    """Inside, output layers give their logits split by vocabulary (a DTensor) and
    ``F.cross_entropy`` of them, forward and backward, runs under torch's ``loss_parallel()``."""
    token = _SPLIT.set(True)
    # torch 2.13's loss_parallel() turns its handlers off only on a plain exit (no finally):
    # it is always left by one, whatever the body raised.
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)
        _SPLIT.reset(token)


def logits_out(gathered: Callable[[nn.Module, Any, DeviceMesh], Any]) -> Callable[[nn.Module, Any, DeviceMesh], Any]:
    """The output function of an output layer (``distribute_module``'s): its DTensor
    output, split by vocabulary, inside ``split_logits()``; ``gathered``'s elsewhere."""

    def finish(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output if _SPLIT.get() else gathered(module, output, mesh)

    return finish


def local(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed on split logits (a replicated DTensor) as a plain tensor; its gradient
    flows back to the DTensor."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def whole(outputs: Any) -> Any:
    """``outputs`` with every DTensor in it gathered whole (a metric's view of split logits);
    a mapping (a Hugging Face ``ModelOutput``) keeps its type."""
    if isinstance(outputs, DTensor):
        return outputs.full_tensor()
    if isinstance(outputs, Mapping):
        gathered = copy.copy(outputs)
        for key, value in outputs.items():
            gathered[key] = whole(value)
        return gathered
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(whole(value) for value in outputs)
    return outputs
