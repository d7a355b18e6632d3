"""What fully sharded data parallelism (FSDP2) shards a model into, and how an accumulated
step keeps its gradients whole until its last micro-batch: shared by ``fsdp`` and by
``tensor`` with ``--shard-replicas`` (FSDP2 over the replicas of a tensor-parallel mesh)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules fsdp shards as units of their own (the root is the last unit).

    A model that names its blocks (a Hugging Face model's ``_no_split_modules``: GPT-2's
    ``GPT2Block``, Llama's ``LlamaDecoderLayer``) is sharded block by block, one all-gather
    a block, as torchtitan and accelerate do; the embeddings and the final norm stay with
    the root. Any other model: every module below the root that holds parameters of its
    own. Either way a unit holds no parameter that a module outside it shares (a language
    model's output layer tied to its input embedding): such a parameter stays with the
    root, since FSDP2 shards each parameter in exactly one unit."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)

    def self_contained(unit: nn.Module) -> bool:
        inside = {id(m) for m in unit.modules()}
        return all(id(owner) in inside for param in unit.parameters() for owner in owners[id(param)])

    def own_unshared(module: nn.Module) -> bool:  # a child with parameters is a unit of its own
        own = list(module.parameters(recurse=False))
        return bool(own) and all(len(owners[id(p)]) == 1 for p in own)

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if blocks:
        return [m for m in model.modules() if m is not model and type(m).__name__ in blocks and self_contained(m)]
    return [m for m in model.modules() if m is not model and own_unshared(m)]


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Backward passes that keep their unsharded gradients (no reduce-scatter) until the
    last micro-batch of an accumulated step."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
