"""A model and optimizer whose parameters are DTensors (fsdp's shards, tensor parallelism's
splits), written into a checkpoint through ``torch.distributed.checkpoint``: every process
writes its own part (``model/`` in the checkpoint folder, each file in the manifest), so
that no process ever holds the whole state, and a checkpoint loads into another layout
(DCP reshards on load). The ``model_files`` role of strategies/roles.py."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from paratrain.errors import ConfigError

#: The folder of a checkpoint that holds the sharded model and optimizer.
SHARDS = "model"


class ShardedModelFiles:
    def save_model(self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> list[str]:
        """Every process writes its part of the model and optimizer to ``folder/model/``
        (a collective); returns the files written there, relative to ``folder``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer)
        target = folder / SHARDS
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=target)
        return sorted(f"{SHARDS}/{path.name}" for path in target.iterdir() if path.is_file())

    def load_model(self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Read the model and optimizer of ``folder`` into this run's layout (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        try:
            dcp.load(state, checkpoint_id=folder / SHARDS)
        except Exception as error:  # DCP wraps every rank's failure in CheckpointException
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(
                f"checkpoint {folder}: its sharded model does not load into this model ({first})"
            ) from None
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
