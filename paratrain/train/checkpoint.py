"""Checkpoints: each process's part of a run's state, and a manifest that makes them one.

A checkpoint is a folder ``DIR/ckpt-<step>/`` of parts, one per process that holds state of its own
(``rank-<i>.pt``, a parameter-server run's ``shard-<i>.pt``), and ``manifest.json``, written last, naming every
part with its size and SHA-256. A folder without a manifest, or whose parts do not match it, is incomplete:
resuming skips it and a later save removes it (checkpoints/store.py). Which part a process writes is its
topology's business (``Topology.checkpoint_part``); how, its role's: the ``Checkpoint`` callback asks the
strategy for the process's state writer (``Strategy.state_writer``, checkpoints/files.py) and calls it at the
loop's events. The callback calls the strategy; the strategy never calls the checkpointer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.checkpoints.files import RunCheckpoints, StateWriter
from paratrain.checkpoints.replica import ReplicaState
from paratrain.checkpoints.store import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointStore
from paratrain.errors import ConfigError
from paratrain.train.callbacks import Callback

if TYPE_CHECKING:
    from paratrain.strategies.base import Strategy

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "Checkpoint", "CheckpointStore", "load_checkpoint"]


def run_signature(strategy: Strategy, model_name: str) -> dict[str, Any]:
    """What a run writes into its manifests and checks when it resumes (checkpoints/signature.py)."""
    describe = strategy.describe()
    return {
        "model": model_name,
        "strategy": describe["strategy"],
        "workers": describe["workers"],
        "ps_shards": describe["ps_shards"],
        "compression": describe["compression"],
        "part_names": strategy.topology.checkpoint_parts(),
    }


class Checkpoint(Callback):
    """Saves every ``every_steps`` steps and at the end of training; with ``resume``, first restores the newest
    complete checkpoint in ``directory`` and the loop goes on from there.

    Give every process the same callback: each writes its own part and the chief commits.
    ``asynchronous`` copies the state to host memory and writes from a thread while training goes on (sharded
    files through DCP's ``async_save``); the next save, a stop at a signal and the end wait for it. Not for a
    parameter server's shards, which always commit in the background.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every_steps: int = 1000,
        keep: int = 5,
        resume: bool = False,
        model_name: str | None = None,
        timeout: float | None = None,
        asynchronous: bool = False,
    ):
        if every_steps < 1 or keep < 1:
            raise ConfigError(f"checkpoints need every_steps >= 1 and keep >= 1, got {every_steps} and {keep}")
        self.store = CheckpointStore(directory, keep)
        self.every_steps, self.resume = every_steps, resume
        self.model_name = model_name
        self.timeout = timeout
        self.asynchronous = asynchronous
        self._files: RunCheckpoints | None = None
        self._writer: StateWriter | None = None

    @property
    def strategy(self) -> Strategy:
        return self.trainer.strategy

    @property
    def restored_step(self) -> int | None:
        """The step of the checkpoint this run resumed from (None: it started afresh)."""
        return self._files.restored_step if self._files is not None else None

    def signature(self) -> dict[str, Any]:
        name = self.model_name or type(self.trainer.module).__name__
        return run_signature(self.strategy, name)

    @property
    def writer(self) -> StateWriter:
        """This process's state writer, chosen by its strategy's role when first asked."""
        if self._writer is None:
            timeout = self.timeout if self.timeout is not None else self.strategy.timeout
            self._files = RunCheckpoints(self.store, self.every_steps, timeout, self.signature, self.asynchronous)
            self._writer = self.strategy.state_writer(self._files, self.trainer) or ReplicaState(
                self._files, self.trainer
            )
        return self._writer

    # ----- the loop's hooks ---------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any]) -> None:
        if self.asynchronous and not self.strategy.checkpoints_in_background:
            raise ConfigError(
                f"Checkpoint(asynchronous=True): {self.strategy.name} writes its checkpoints on its own schedule "
                "(a parameter server's shards commit from a thread always); save synchronously (asynchronous=False)"
            )
        if self.resume:
            self.writer.restore()
        elif self.writer.checks_fresh_folder:
            self.store.refuse_to_start_over()
        if self.strategy.is_chief:
            self.store._makedirs(self.store.root)

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step % self.every_steps == 0:
            self.writer.at_step(step)  # asynchronous: written while training goes on

    def on_train_end(self, logs: dict[str, Any]) -> None:
        self.writer.at_end(self.trainer.global_step)
        self._files.finish(None)  # the save under way, whichever writer started it

    def on_stop(self, step: int, logs: dict[str, Any]) -> None:
        """Saved where the loop stands, mid-epoch: the save at the end would hold the epoch
        closed, and a resumed run would skip the rest of it."""
        self.writer.at_step(step)

    def on_train_left(self, logs: dict[str, Any]) -> None:
        if self._files is not None:
            self._files.finish(None)  # the save this replica began, whose step the run counts on

    def save(self, step: int) -> None:
        """Write this process's part of step ``step`` now (a stop at a signal asks for one)."""
        self.writer.at_step(step)
        self._files.finish(None)

    # ----- a process that serves (a parameter-server shard) -------------------------------
    def on_serve_begin(self, logs: dict[str, Any]) -> None:
        writer = self.writer  # chosen now, with the run's signature as it starts
        if self.resume:
            writer.restore()

    def on_version(self, version: int) -> None:
        """A shard published ``version`` (its state is that version's), or a worker received it."""
        self.writer.at_version(version)

    def on_serve_end(self, logs: dict[str, Any]) -> None:
        self.writer.at_end(self.trainer.global_step)


def load_checkpoint(path: str | os.PathLike, part: str = "rank-0", map_location: Any = "cpu") -> dict[str, Any]:
    """One part of a checkpoint: ``path`` is a checkpoint folder (``ckpt-<step>``) or a
    folder of them (the newest complete one). Rank 0's part holds ``model`` and
    ``optimizer`` (state_dicts), ``trainer`` (position, history, random generators) and
    ``strategy``. ConfigError if there is no complete checkpoint or it does not read."""
    folder = Path(path).expanduser()
    if not (folder / MANIFEST).exists():
        latest = CheckpointStore(folder).latest()
        if latest is None:
            raise ConfigError(f"checkpoint {folder}: no complete checkpoint there")
        folder = latest
    manifest = CheckpointStore.read_manifest(folder)
    return CheckpointStore.read_part(folder, part, manifest, map_location)
