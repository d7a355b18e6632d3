"""What a batch may be: ``(inputs, targets)``, where ``inputs`` is a tensor, a tuple or
list of tensors (the model is called as ``model(*inputs)``), or a dict of tensors
(``model(**inputs)``), and ``targets`` a tensor whose first dimension counts the examples;
or a dict of tensors alone (``input_ids``, ``attention_mask``, ``labels``: what a
``datasets.Dataset`` gives), which is both the inputs (``model(**batch)``) and what the
loss is given (``loss(outputs, batch)``; the model's own loss by default, scores.py).

Every strategy moves, slices and feeds batches through these few functions, so a
multi-input model trains the same way under each of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``value`` with every tensor in it (nested tuples, lists, dicts) on ``device``.

    ``non_blocking`` from host to a GPU copies through page-locked memory: a copy from
    pageable memory holds the host until the GPU has run every step queued before it, so the
    host could never queue the next step's kernels while the GPU runs this one."""
    if torch.is_tensor(value):
        if non_blocking and device.type == "cuda" and value.device.type == "cpu" and not value.is_pinned():
            value = value.pin_memory()
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, non_blocking) for v in value)
    return value


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor in it."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def num_examples(targets: Any) -> int:
    """Examples in a batch: the first dimension of its targets."""
    if torch.is_tensor(targets):
        return len(targets) if targets.dim() else 1
    if isinstance(targets, Mapping):
        return num_examples(next(iter(targets.values())))
    if isinstance(targets, (tuple, list)) and targets:
        return num_examples(targets[0])
    return len(targets)


def part_of(total: int, part: int, parts: int) -> slice:
    """Part ``part``'s examples of a batch of ``total`` among ``parts`` (a fault-tolerant
    participant's of the global batch, a replica's of a stream's last batch): consecutive,
    sizes within one of each other, every example in exactly one part."""
    return slice(part * total // parts, (part + 1) * total // parts)


def split_batch(inputs: Any, targets: Any, parts: int) -> list[tuple[Any, Any, int]]:
    """``(inputs, targets, examples)`` of ``parts`` consecutive micro-batches of one batch
    (gradient accumulation); the last ones are smaller when the batch does not divide."""
    n = num_examples(targets)
    if parts <= 1:
        return [(inputs, targets, n)]
    sizes = [len(chunk) for chunk in torch.arange(n).tensor_split(parts) if len(chunk)]
    out, start = [], 0
    for size in sizes:
        piece = slice(start, start + size)
        out.append((map_tensors(inputs, lambda t, p=piece: t[p]), map_tensors(targets, lambda t, p=piece: t[p]), size))
        start += size
    return out


def as_pair(item: Any, where: str) -> tuple[Any, Any]:
    """``item`` as ``(inputs, targets)``: a dict batch is both; ConfigError for what is
    neither a pair nor a dict."""
    if isinstance(item, Mapping):
        return item, item
    check_pair(item, where)
    return item[0], item[1]


def check_pair(item: Any, where: str) -> None:
    """ConfigError unless ``item`` is an ``(inputs, targets)`` pair."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        kind = type(item).__name__ + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
        raise ConfigError(
            f"{where} gave a {kind}; each example or batch must be an (inputs, targets) pair, "
            "inputs a tensor, a tuple of tensors (model(*inputs)) or a dict of them (model(**inputs)); "
            "or a dict of tensors alone (model(**batch), the model's own loss)"
        )
