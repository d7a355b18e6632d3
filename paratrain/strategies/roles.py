"""What some strategies' processes do beyond training one replica, each a role of its own
that the Trainer and the checkpointer ask for (``Strategy.server``, ``Strategy.remote``,
``Strategy.model_files``, ``Strategy.state_writer``) instead of methods every strategy
carries:

- a *server* serves instead of training (a parameter-server shard): ``Trainer.fit`` runs
  it in place of its loop;
- a *remote* view is a training process whose state another holds (a parameter-server
  worker: the shards hold the parameters, the optimizer and the run's position);
- *model files* write the model and optimizer in the mode's own form (fsdp: sharded);
- a *state writer* (checkpoints/files.py) puts a process's state into checkpoints where
  its role writes otherwise than a training replica (a shard at the versions it publishes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class FitLoop(Protocol):
    """What a strategy may read and set of the loop that drives it (the Trainer,
    train/trainer.py): its position and the state a replica that joins takes over."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    batch: int
    """Batches of the current epoch done."""
    epoch: int
    global_step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def example_batch(self) -> tuple[Any, Any]:
        """The first batch of this replica's training data."""


class Server(Protocol):
    on_version: Callable[[int], None]
    """Called with each parameter version the server publishes (checkpoints, fault drills)."""

    def serve(self) -> Any:
        """Serve until training ends (the classic ``server.join()``)."""


class Remote(Protocol):
    def examples_applied(self) -> int:
        """Examples in all the updates applied so far, run-wide, as this process knows it."""

    def refresh(self, model: nn.Module) -> None:
        """Bring ``model`` up to the servers' current parameters (before evaluating)."""


class ModelFiles(Protocol):
    def save_model(self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> list[str]:
        """Write the model and optimizer into checkpoint ``folder`` (every process calls it);
        the files written, relative to ``folder``."""

    def start_save(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, group: Any
    ) -> Callable[[], list[str]]:
        """``save_model`` from a copy taken now, written while training goes on, planned over
        ``group`` (``--checkpoint-async``, where ``checkpoints_in_background``); what waits
        for the write and names its files."""

    def load_model(self, module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Read back what ``save_model`` wrote into ``folder`` (every process calls it)."""
