"""Checkpoints: each process's part of a run's state, and a manifest that makes them one.

A checkpoint is a folder ``DIR/ckpt-<step>/`` of parts, one per process that holds state
of its own (``rank-0.pt``, ``rank-1.pt``, ...; a parameter-server run's ``shard-0.pt``,
...), and ``manifest.json``, written last, naming every part with its size and SHA-256.
A folder without a manifest, or whose parts do not match it, is incomplete: resuming
skips it, and a later save removes it (paratrain/checkpoints/store.py).

Which part each process writes is its strategy's topology's business
(``Topology.checkpoint_part``, ``model_part``); how is its role's: the ``Checkpoint``
callback asks the strategy for its process's state writer (``Strategy.state_writer``,
checkpoints/files.py) and calls it at the loop's events. A training replica's writer is
here (``ReplicaState``): under allreduce every rank saves its position, random generators
and codec residuals, and rank 0 alone the (identical) model and optimizer; each pipeline
stage saves its own stage. A parameter-server run's writers are in its folder
(strategies/ps/checkpoint.py). The callback calls the strategy; the strategy never calls
the checkpointer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.checkpoints.files import RunCheckpoints, StateWriter
from paratrain.checkpoints.signature import check_signature
from paratrain.checkpoints.store import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointStore
from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.train.callbacks import Callback

if TYPE_CHECKING:
    from paratrain.strategies.base import Strategy
    from paratrain.train.trainer import Trainer

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
    """Saves every ``every_steps`` steps and at the end of training; with ``resume``, first
    restores the newest complete checkpoint in ``directory`` (if there is one) and the loop
    goes on from there.

    Every process of the run takes part (give every process the same callback); each
    writes its own part and the chief commits the checkpoint. The CIFAR-10 recipe's Saver
    (every 1000 steps, the last 5 kept) is ``Checkpoint(dir, 1000, keep=5)``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every_steps: int = 1000,
        keep: int = 5,
        resume: bool = False,
        model_name: str | None = None,
        timeout: float | None = None,
    ):
        if every_steps < 1 or keep < 1:
            raise ConfigError(f"checkpoints need every_steps >= 1 and keep >= 1, got {every_steps} and {keep}")
        self.store = CheckpointStore(directory, keep)
        self.every_steps, self.resume = every_steps, resume
        self.model_name = model_name
        self.timeout = timeout
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
            self._files = RunCheckpoints(self.store, self.every_steps, timeout, self.signature)
            self._writer = self.strategy.state_writer(self._files, self.trainer) or ReplicaState(
                self._files, self.trainer
            )
        return self._writer

    # ----- the loop's hooks ---------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any]) -> None:
        if self.strategy.is_chief:
            self.store._makedirs(self.store.root)
        if self.resume:
            self.writer.restore()

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step % self.every_steps == 0:
            self.save(step)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        self.writer.at_end(self.trainer.global_step)

    def save(self, step: int) -> None:
        """Write this process's part of step ``step`` (a stop at a signal asks for one too)."""
        self.writer.at_step(step)

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


class ReplicaState:
    """The state writer of a training replica (a process of allreduce, fsdp, a pipeline
    stage, local SGD): its part at steps, the model where its topology says."""

    def __init__(self, files: RunCheckpoints, trainer: Trainer):
        self.files, self.trainer = files, trainer
        self.strategy = trainer.strategy
        rank = self.strategy.process_rank
        self.part = self.strategy.topology.checkpoint_part(rank)
        self.model_part = self.strategy.topology.model_part(rank)

    def at_step(self, step: int) -> None:
        """Write this process's part of step ``step``; on the chief, commit the checkpoint."""
        if step == self.files.last_saved:
            return
        trainer, strategy, store = self.trainer, self.strategy, self.files.store
        trainer.check_finite()  # never save a model that has diverged
        state: dict[str, Any] = {"trainer": trainer.state_dict(), "strategy": strategy.state_dict()}
        folder = store.folder(step)
        store._makedirs(folder)
        files = strategy.model_files
        own_files = files.save_model(trainer.module, trainer.optimizer, folder) if files is not None else None
        if own_files is None and self.model_part == self.part:
            state["model"] = trainer.module.state_dict()
            state["optimizer"] = trainer.optimizer.state_dict()
        store.write_part(step, self.part, state)
        self.files.last_saved = step
        if strategy.is_chief:
            parts = strategy.topology.checkpoint_parts() + (own_files or [])
            # The replicas beside the processes: where a replica is several processes
            # (tensor), a resume on another layout carries the data position by replicas.
            meta = {**self.files.signature(), "replicas": strategy.num_replicas}
            store.commit(step, parts, meta, self.files.timeout)

    def at_version(self, version: int) -> None:
        """A replica publishes no versions."""

    def at_end(self, step: int) -> None:
        self.at_step(step)

    def restore(self) -> None:
        """Load the newest complete checkpoint into this process (nothing if there is none)."""
        strategy = self.strategy
        speaks = strategy.is_chief
        folder = self.files.choose(speaks)
        if folder is None:
            return
        manifest = CheckpointStore.read_manifest(folder)
        reshards = strategy.reshards
        check_signature(folder, manifest, self.files.signature(), reshards)
        part, model_part = self.part, self.model_part
        if reshards and part not in manifest["parts"]:  # a replica the saving run did not have
            part = model_part = "rank-0"
        device = strategy.device
        own = CheckpointStore.read_part(folder, part, manifest, map_location=device)
        if model_part is not None:
            held = (
                own
                if model_part == part
                else CheckpointStore.read_part(folder, model_part, manifest, map_location=device)
            )
            self._load_model(folder, held, manifest)
        saved_replicas, replicas = manifest.get("replicas", manifest.get("workers")), strategy.num_replicas
        strategy_state = own["strategy"]
        if reshards:
            strategy_state = strategy.reshard_state(strategy_state, int(saved_replicas))
        strategy.load_state_dict(strategy_state)
        self.trainer.load_state_dict(own["trainer"])
        if reshards and saved_replicas != replicas:
            self.trainer.carry_position(int(saved_replicas), replicas)
            if speaks:
                console.print(
                    f"paratrain: {folder} was written by {saved_replicas} replicas, this run has {replicas}: "
                    f"the model is resharded and epoch {self.trainer.epoch + 1} goes on at batch {self.trainer.batch}"
                )
        self.files.restored(int(manifest["step"]), speaks)
        if speaks:
            console.print(f"paratrain: resumed from {folder} (step {self.files.restored_step})")

    def _load_model(self, folder: Path, state: dict[str, Any], manifest: dict[str, Any]) -> None:
        if "model" not in state and any("/" in name for name in manifest["parts"]):
            # The mode wrote the model in its own files (fsdp: sharded), every process its part.
            CheckpointStore.check_files(folder, manifest)
            files = self.strategy.model_files
            if files is None:
                raise ConfigError(
                    f"checkpoint {folder}: its model was saved sharded (fsdp), which {self.strategy.name} cannot read"
                )
            files.load_model(self.trainer.module, self.trainer.optimizer, folder)
            return
        if "model" not in state:
            raise ConfigError(f"checkpoint {folder}: its part for this process holds no model")
        try:
            self.trainer.module.load_state_dict(state["model"])
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:
            raise ConfigError(
                f"checkpoint {folder} holds another model or optimizer ({str(error).splitlines()[0].strip()})"
            ) from None


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
