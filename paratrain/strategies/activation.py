"""Activation checkpointing: a block keeps only its input for the backward pass and computes its forward pass
again there, trading compute for the memory of its activations.

``--activation-checkpointing``: ``none`` (default), ``blocks`` (every block), or ``every-K`` (every K-th block:
about 1/K of the saving for 1/K of the recomputation). A model's blocks are the modules it names in
``_no_split_modules``, else the children of an ``nn.Sequential`` root. PyTorch's non-reentrant checkpointing
restores the random state for the recomputation, so gradients equal those without it, dropout included;
state-dict keys stay the model's own.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from paratrain.errors import ConfigError

CHOICES = "none, blocks or every-K (K >= 1)"


def checkpoint_every(value: str) -> int:
    """``none`` -> 0, ``blocks`` -> 1, ``every-K`` -> K; ConfigError for anything else."""
    if value == "none":
        return 0
    if value == "blocks":
        return 1
    match = re.fullmatch(r"every-([1-9][0-9]*)", value)
    if match is None:
        raise ConfigError(f"--activation-checkpointing {value!r}: valid: {CHOICES}")
    return int(match.group(1))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in order (see the module's docstring)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if isinstance(model, nn.Sequential):
        return [m for m in model if any(True for _ in m.parameters())]
    return []


def checkpoint_activations(model: nn.Module, every: int) -> int:
    """Checkpoint every ``every``-th block of ``model`` in place; returns how many.
    ConfigError where the model names no blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    found = blocks(model)
    if not found:
        raise ConfigError(
            f"--activation-checkpointing: {type(model).__name__} names no blocks to checkpoint (an nn.Sequential, "
            "or a model with _no_split_modules, as Hugging Face models have)"
        )
    chosen = {id(m) for m in found[::every]}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: id(module) in chosen,
    )
    return len(chosen)


def saved_activation_bytes(forward: Callable[[], torch.Tensor], model: nn.Module | None = None) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of ``forward()`` (a loss):
    each storage counted once, the parameters of ``model`` not at all. What checkpointed
    blocks keep inside is recomputed, not kept, and is not counted."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if not isinstance(tensor, nn.Parameter) and storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(kept.values())
