"""The state writer of a training replica (``ReplicaState``): under allreduce every rank
saves its position, random generators and codec residuals, and rank 0 alone the (identical)
model and optimizer; each pipeline stage saves its own stage. The ``Checkpoint`` callback
(train/checkpoint.py) uses it where the strategy names no writer of its own; a strategy may
compose it into its own (strategies/fault_tolerant/checkpoint.py)."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.checkpoints.files import RunCheckpoints, copy_state
from paratrain.checkpoints.signature import check_signature
from paratrain.checkpoints.store import CheckpointStore
from paratrain.console import console
from paratrain.errors import ConfigError

#: What the chief commits: the parts its topology names (the model's own files are added
#: once written) and the manifest's description of the run.
Commit = tuple[list[str], dict[str, Any]] | None


class ReplicaState:
    """The state writer of a training replica (a process of allreduce, fsdp, a pipeline
    stage, local SGD): its part at steps, the model where its topology says."""

    checks_fresh_folder = True  # a checkpoint needs every process's part: none before all start

    def __init__(self, files: RunCheckpoints, trainer: Any):
        self.files, self.trainer = files, trainer
        self.strategy = trainer.strategy
        rank = self.strategy.process_rank
        self.part = self.strategy.topology.checkpoint_part(rank)
        self.model_part = self.strategy.topology.model_part(rank)
        self._group: Any = None  # background sharded saves' own process group (_save_group)
        self.token: str | None = None
        """Where set, each save's parts carry it and the chief commits only parts that do: a
        token of this life of the writing processes, where a save may find the parts of one
        a crash cut short (a fault-tolerant replica's, strategies/fault_tolerant/checkpoint.py)."""

    def at_step(self, step: int) -> None:
        """Write this process's part of step ``step``; on the chief, commit the checkpoint.
        With ``--checkpoint-async`` both happen on a thread, from a copy of the state taken
        now, and this returns once the copy is made (a save still under way first ends)."""
        self.files.finish(None)  # one save at a time; what a failed one raised is raised here
        if step == self.files.last_saved:
            return
        trainer = self.trainer
        strategy = self.strategy
        store = self.files.store
        trainer.check_finite()  # never save a model that has diverged
        state: dict[str, Any] = {"trainer": trainer.state_dict(), "strategy": strategy.state_dict()}
        folder = store.folder(step)
        store._makedirs(folder)
        files = strategy.model_files
        background = self.files.asynchronous
        own_files: Callable[[], list[str]] = list  # the model's own files' names, once written
        if files is not None and background:  # copied now, written by DCP's thread
            own_files = files.start_save(trainer.module, trainer.optimizer, folder, self._save_group())
        elif files is not None:
            own_files = functools.partial(list, files.save_model(trainer.module, trainer.optimizer, folder))
        elif self.model_part == self.part:
            state["model"] = trainer.module.state_dict()
            state["optimizer"] = trainer.optimizer.state_dict()
        commit = None
        if strategy.is_chief:
            # The replicas beside the processes: where a replica is several processes
            # (tensor), a resume on another layout carries the data position by replicas.
            meta = {
                **self.files.signature(),
                "replicas": strategy.num_replicas,
                "processes": strategy.topology.num_processes,
                "batches_per_step": strategy.topology.batches_per_step,
            }
            commit = (strategy.topology.checkpoint_parts(), meta)
        self.files.last_saved = step
        if background:
            copied = copy_state(state)
            self.files.in_background(lambda: self._write_unless_moot(step, copied, commit, own_files))
        else:
            self._write(step, state, commit, own_files)

    def _write(self, step: int, state: dict[str, Any], commit: Commit, own_files: Callable[[], list[str]]) -> None:
        store = self.files.store
        store.write_part(step, self.part, state, self.token)
        written = own_files()  # every process's model files, where the strategy writes its own
        if commit is not None:
            parts, meta = commit
            store.commit(step, parts + written, meta, self.files.timeout, self.token)

    def _save_group(self) -> Any:
        """The Gloo group of the run's processes that background sharded saves plan over,
        made at the first (every process saves at the same steps)."""
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.files.timeout))
        return self._group

    def _write_unless_moot(
        self, step: int, state: dict[str, Any], commit: Commit, own_files: Callable[[], list[str]]
    ) -> None:
        """A save on a thread: its failure is moot where a later checkpoint is complete
        already (a fault-tolerant run's next save, by another replica, removed this one's
        unfinished folder), and raised at the next save otherwise."""
        try:
            self._write(step, state, commit, own_files)
        except (ConfigError, RuntimeError):
            complete = self.files.store.complete()
            if not complete or complete[0][0] <= step:
                raise

    def at_version(self, version: int) -> None:
        """A replica publishes no versions."""

    def at_end(self, step: int) -> None:
        self.at_step(step)  # the Checkpoint callback then waits for it (train/checkpoint.py)

    def restore(self, peers_write: bool = False) -> None:
        """Load the newest complete checkpoint into this process (nothing if there is none);
        ``peers_write``: live peers may be saving later steps meanwhile (files.restored)."""
        strategy = self.strategy
        speaks = strategy.is_chief
        folder = self.files.choose(speaks)
        if folder is None:
            return
        manifest = CheckpointStore.read_manifest(folder)
        reshards = strategy.reshards
        signature = self.files.signature()
        check_signature(folder, manifest, signature, reshards)
        part, model_part = self.part, self.model_part
        if reshards and part not in manifest["parts"]:  # a process the saving run did not have
            part = model_part = strategy.topology.checkpoint_part(0)
        device = strategy.device
        own = CheckpointStore.read_part(folder, part, manifest, map_location=device)
        saved_replicas, replicas = manifest.get("replicas", manifest.get("workers")), strategy.num_replicas
        if saved_replicas is None:
            raise ConfigError(f"checkpoint {folder}: its manifest names no replicas or workers; not paratrain's")
        strategy_state = _held(own, "strategy", folder, part)
        if reshards:
            strategy_state = strategy.reshard_state(strategy_state, int(saved_replicas))
        # The strategy's state first: it names a part written elsewhere in the layout (a
        # pipeline's stage and shard) before its model fails to load here.
        strategy.load_state_dict(strategy_state)
        if model_part is not None:
            held = (
                own
                if model_part == part
                else CheckpointStore.read_part(folder, model_part, manifest, map_location=device)
            )
            self._load_model(folder, held, manifest)
        self.trainer.load_state_dict(_held(own, "trainer", folder, part))
        saved_batches = int(manifest.get("batches_per_step", saved_replicas))
        if reshards and saved_batches != strategy.topology.batches_per_step:
            self.trainer.carry_position(saved_batches, strategy.topology.batches_per_step)
        if reshards and speaks and manifest.get("part_names", signature["part_names"]) != signature["part_names"]:
            then = _layout(int(saved_replicas), int(manifest.get("processes", saved_replicas)))
            now = _now(replicas, strategy.topology.num_processes)
            console.print(
                f"paratrain: {folder} was written by {then}, this run has {now}: "
                f"the model is resharded and epoch {self.trainer.epoch + 1} goes on at batch {self.trainer.batch}"
            )
        self.files.restored(int(manifest["step"]), speaks, peers_write)
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

        def load() -> None:
            try:
                self.trainer.module.load_state_dict(state["model"])
                self.trainer.optimizer.load_state_dict(state["optimizer"])
            except (RuntimeError, ValueError, KeyError) as error:
                raise ConfigError(
                    f"checkpoint {folder} holds another model or optimizer ({str(error).splitlines()[0].strip()})"
                ) from None

        self.strategy.when_model_made(load)


def _held(state: dict[str, Any], key: str, folder: Path, part: str) -> Any:
    """``state[key]``, or one line where a part holds no such entry (not written by paratrain)."""
    if not isinstance(state, dict) or key not in state:
        raise ConfigError(f"checkpoint {folder}: its part {part} holds no {key!r} state; not written by paratrain")
    return state[key]


def _layout(replicas: int, processes: int) -> str:
    """``2 replicas``, or ``1 replica of 4 processes`` where a replica is several."""
    counted = f"{replicas} replica" + ("" if replicas == 1 else "s")
    return counted if processes == replicas else f"{counted} of {processes} processes"


def _now(replicas: int, processes: int) -> str:
    """``3``, or ``1 replica of 4 processes`` where a replica is several."""
    return str(replicas) if processes == replicas else _layout(replicas, processes)
