"""State dicts of a module and optimizer whose parameters are DTensors, held as each
process's own part: plain tensors in a process's checkpoint file (written and read with
``weights_only``), made DTensors again, placed as the live parameters are, when read back.

This is what a process hands a peer of the same layout (a fault-tolerant replica's shard
heals the same shard of a replacement) and the checkpoint of a layout that resumes on the
same layout (a pipeline's stages split by tensor parallelism: each process writes its own
stage's part); a layout that reshards on load goes through ``torch.distributed.checkpoint``
instead (strategies/sharded_files.py), with the hooks set aside (``LocalParts.whole``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class LocalParts:
    """The hooks of ``hold_local_parts``: on, except inside ``whole()``."""

    def __init__(self) -> None:
        self.on = True

    @contextmanager
    def whole(self) -> Iterator[None]:
        """The state dicts as the module and optimizer give them (DTensors), for a while."""
        self.on = False
        try:
            yield
        finally:
            self.on = True


def hold_local_parts(module: nn.Module, optimizer: torch.optim.Optimizer) -> LocalParts:
    """Hooks on ``module`` and ``optimizer``: their state dicts give each DTensor's local
    part, and take a local part where the live state has a DTensor."""
    live = module.state_dict(keep_vars=True)
    parts = LocalParts()

    def module_local(_module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        if prefix == "" and parts.on:
            for key, value in state.items():
                state[key] = _local(value)

    def module_placed(_module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix == "" and parts.on:
            for key, value in state.items():
                if key in live:
                    state[key] = _placed(value, live[key])

    module.register_state_dict_post_hook(module_local)
    module.register_load_state_dict_pre_hook(module_placed)

    def optimizer_local(_optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any] | None:
        if not parts.on:
            return None
        held = {index: {k: _local(v) for k, v in values.items()} for index, values in state["state"].items()}
        return {**state, "state": held}

    def optimizer_placed(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any] | None:
        if not parts.on:
            return None
        params = [p for group in opt.param_groups for p in group["params"]]
        indices = [i for group in state["param_groups"] for i in group["params"]]
        by_index = dict(zip(indices, params))
        held = {
            index: {k: _placed(v, by_index[index]) if index in by_index else v for k, v in values.items()}
            for index, values in state["state"].items()
        }
        return {**state, "state": held}

    optimizer.register_state_dict_post_hook(optimizer_local)
    optimizer.register_load_state_dict_pre_hook(optimizer_placed)
    return parts


def _local(value: Any) -> Any:
    return value.to_local().detach().clone() if isinstance(value, DTensor) else value


def _placed(value: Any, like: Any) -> Any:
    """``value`` (a local part) as a DTensor placed as ``like``; anything else as it is (a
    scalar step count, a tensor ``like`` holds whole)."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor) or not torch.is_tensor(value):
        return value
    if tuple(value.shape) != tuple(like.to_local().shape):
        return value  # load_state_dict names the mismatch
    local = value.to(device=like.device, dtype=like.dtype)
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
