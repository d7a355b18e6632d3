"""Which losses ``tensor`` computes on logits split by vocabulary (``--loss-parallel``,
parallel/vocabulary.py), and which get them whole.

Split: a loss that is ``F.cross_entropy`` of the outputs with the classes last, which says
so with ``loss_parallel = True`` (scores.py's ``cross_entropy`` and the default loss of an
``(inputs, targets)`` pair; a user's loss may say it too); and the model's own loss of a
dict batch where it is a Hugging Face causal language model's (transformers'
``ForCausalLMLoss``: ``F.cross_entropy`` of ``logits.view(-1, vocabulary)``, computed in the
model's forward, under the context as well). Whole, as without the option: any other loss
(one of the user's own that is no cross-entropy: it is given plain tensors, the logits
gathered, rather than refused), a model's own loss that is not known to be a
cross-entropy, and every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from paratrain.parallel.vocabulary import local

#: transformers' loss functions (a model's ``loss_function``) that are ``F.cross_entropy`` of
#: the logits flattened to (positions, vocabulary): loss_parallel takes them split.
CROSS_ENTROPY_OWN_LOSSES = ("ForCausalLMLoss",)


def own_loss_splits(model: nn.Module) -> bool:
    """Whether ``model`` computes its own loss (given labels) as a cross-entropy that takes
    its logits split: a Hugging Face causal language model's."""
    own = getattr(model, "loss_function", None)
    return getattr(own, "__name__", "") in CROSS_ENTROPY_OWN_LOSSES


def takes_split_logits(loss_fn: Callable[..., Any], targets: Any, own_splits: bool) -> bool:
    """Whether ``loss_fn`` of a batch with ``targets`` takes the logits split by vocabulary:
    the model's own loss of a dict batch where ``own_splits``, else a loss marked
    ``loss_parallel``."""
    if isinstance(targets, Mapping) and getattr(loss_fn, "uses_model_loss", False):
        return own_splits
    return bool(getattr(loss_fn, "loss_parallel", False))


def plain_loss(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` giving a plain tensor where it computes on split logits (a replicated
    DTensor), for the loop's sums and reductions."""
    return lambda outputs, targets: local(loss_fn(outputs, targets))
