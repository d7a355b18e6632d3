"""A model and optimizer whose parameters are DTensors (fsdp's shards, tensor parallelism's
splits), written into a checkpoint through ``torch.distributed.checkpoint``: every process
writes its own part (``model/`` in the checkpoint folder, each file in the manifest), so
that no process ever holds the whole state, and a checkpoint loads into another layout
(DCP reshards on load); with ``--checkpoint-async``, from a copy in host memory while
training goes on (DCP's ``async_save``). The ``model_files`` role of strategies/roles.py.

DCP writes each process's part as a block of the whole tensor; a part that is not one
(a packed projection split by tensor parallelism: its slice of each projection, a
strided shard) is written as the contiguous shard it equals, and made strided again
when read back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from paratrain.errors import ConfigError

#: The folder of a checkpoint that holds the sharded model and optimizer.
SHARDS = "model"


class ShardedModelFiles:
    def save_model(self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> list[str]:
        """Every process writes its part of the model and optimizer to ``folder/model/``
        (a collective); returns the files written there, relative to ``folder``."""
        import torch.distributed.checkpoint as dcp

        dcp.save(_to_save(module, optimizer), checkpoint_id=folder / SHARDS)
        return _written(folder)

    def start_save(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, group: Any
    ) -> Callable[[], list[str]]:
        """``save_model`` in the background (``--checkpoint-async``): this process's part is
        copied to host memory now, and written from a thread of DCP's while training goes on,
        its planning collectives over ``group`` (a Gloo group of the run's processes of its
        own, so that they never meet training's collectives). Returns what waits for the
        write to end everywhere and names the files, as ``save_model`` does."""
        import torch.distributed.checkpoint as dcp

        writing = dcp.async_save(_to_save(module, optimizer), checkpoint_id=folder / SHARDS, process_group=group)

        def files() -> list[str]:
            writing.result()  # raises what the write raised
            return _written(folder)

        return files

    def load_model(self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Read the model and optimizer of ``folder`` into this run's layout (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer)
        layout = {"model": model_state, "optimizer": optimizer_state}
        state = _contiguous(layout)
        try:
            dcp.load(state, checkpoint_id=folder / SHARDS)
        except Exception as error:  # DCP wraps every rank's failure in CheckpointException
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(
                f"checkpoint {folder}: its sharded model does not load into this model ({first})"
            ) from None
        state = _placed_as(state, layout)
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _to_save(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state as DCP writes it (each process's own shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(module, optimizer)
    return _contiguous({"model": model_state, "optimizer": optimizer_state})


def _written(folder: Path) -> list[str]:
    """The files DCP wrote into checkpoint ``folder``, relative to it."""
    return sorted(f"{SHARDS}/{path.name}" for path in (folder / SHARDS).iterdir() if path.is_file())


def _contiguous(state: Any) -> Any:
    """``state`` (nested dicts and lists) with each strided DTensor as the contiguous shard
    of the same whole tensor."""
    if isinstance(state, dict):
        return {key: _contiguous(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_contiguous(value) for value in state]
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in state.placements]
        return state.redistribute(state.device_mesh, placements)
    return state


def _placed_as(state: Any, layout: Any) -> Any:
    """``state`` read back, each DTensor placed as its counterpart in ``layout`` is."""
    if isinstance(state, dict):
        return {key: _placed_as(value, layout[key]) for key, value in state.items()}
    if isinstance(state, list):
        return [_placed_as(value, like) for value, like in zip(state, layout)]
    if isinstance(state, DTensor) and isinstance(layout, DTensor) and state.placements != layout.placements:
        return state.redistribute(layout.device_mesh, layout.placements)
    return state
