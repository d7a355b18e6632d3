"""Checkpoints: each process's part of a run's state, and a manifest that makes them one.

A checkpoint is a folder ``DIR/ckpt-<step>/`` of parts, one per process that holds state
of its own (``rank-0.pt``, ``rank-1.pt``, ...; a parameter-server run's ``shard-0.pt``,
...), and ``manifest.json``, written last, naming every part with its size and SHA-256.
A folder without a manifest, or whose parts do not match it, is incomplete: resuming
skips it, and a later save removes it.

Every file is written to a temporary name in the same folder, flushed to disk, and
renamed over its final name, so a crash leaves the file whole or absent; the folder is
synced after the rename. A part holds tensors and plain values only: it is read with
``torch.load(weights_only=True)``, which never runs code from the file.

Which part each process writes is its strategy's topology's business
(``Topology.checkpoint_part``, ``model_part``); what goes in it is the strategy's
``state_dict`` and the Trainer's: under allreduce every rank saves its position, random
generators and codec residuals, and rank 0 alone the (identical) model and optimizer;
each pipeline stage saves its own stage; each parameter-server shard saves its slice of
the parameters, its optimizer, its version and where the epoch's batches stand, at each
version it publishes (``on_version``), and a parameter-server worker whose codec keeps
state writes that beside the parts (``worker-<i>.pt``, outside the manifest). The
Checkpoint callback calls the strategy; the strategy never calls the checkpointer.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.train.callbacks import Callback
from paratrain.train.checkpoint_store import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointStore

if TYPE_CHECKING:
    from paratrain.strategies.base import Strategy

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "Checkpoint", "CheckpointStore", "load_checkpoint"]


def run_signature(strategy: Strategy, model_name: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the model and how the run is split."""
    describe = strategy.describe()
    return {
        "model": model_name,
        "strategy": describe["strategy"],
        "workers": describe["workers"],
        "ps_shards": describe["ps_shards"],
        "compression": describe["compression"],
        "part_names": strategy.topology.checkpoint_parts(),
    }


#: What may differ when a mode's checkpoints reshard (``Strategy.reshards``): how many
#: replicas, and how many parameter-server shards.
_RESHARDABLE = ("workers", "ps_shards", "part_names")


def check_signature(folder: Path, manifest: dict[str, Any], signature: dict[str, Any], reshards: bool = False) -> None:
    differ = [
        key for key in signature if manifest.get(key) != signature[key] and not (reshards and key in _RESHARDABLE)
    ]
    if differ:
        then = ", ".join(f"{k}={manifest.get(k)}" for k in differ if k != "part_names")
        now = ", ".join(f"{k}={signature[k]}" for k in differ if k != "part_names")
        if not then:  # only the parts differ: the run is split differently
            then, now = f"parts {manifest.get('part_names')}", f"parts {signature['part_names']}"
        raise ConfigError(
            f"checkpoint {folder} was written by a run with {then}; this run has {now}: "
            f"resume with the same settings, or give a new --checkpoint-dir"
        )


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
        self.restored_step: int | None = None
        """The step of the checkpoint this run resumed from (None: it started afresh)."""
        self._last_saved = -1  # the step (a parameter-server run: the version) saved last
        self._committing: threading.Thread | None = None
        self._signature: dict[str, Any] = {}
        self._own_state: bool | None = None  # a parameter-server worker keeps state of its own

    @property
    def strategy(self) -> Strategy:
        return self.trainer.strategy

    def signature(self) -> dict[str, Any]:
        name = self.model_name or type(self.trainer.module).__name__
        return run_signature(self.strategy, name)

    def _timeout(self) -> float:
        return self.timeout if self.timeout is not None else self.strategy.timeout

    @property
    def _part(self) -> str | None:
        """The part this process writes (None: a parameter-server worker)."""
        return self.strategy.topology.checkpoint_part(self.strategy.process_rank)

    @property
    def _model_part(self) -> str | None:
        return self.strategy.topology.model_part(self.strategy.process_rank)

    # ----- the loop's hooks ---------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any]) -> None:
        if self.strategy.is_chief:
            self.store._makedirs(self.store.root)
        if self.resume:
            self.restore()

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step % self.every_steps == 0:
            self.save(step)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        self.save(self.trainer.global_step)
        if self._part is None:  # a parameter-server worker: its state as of the final version
            self._save_beside(None, final=True)

    # ----- a process that serves (a parameter-server shard) -----------------------------------
    def on_serve_begin(self, logs: dict[str, Any]) -> None:
        """Before serving: with ``resume``, load this shard's part of the newest complete
        checkpoint. The shard then saves its part every ``every_steps`` versions."""
        self._signature = self.signature()
        if not self.resume:
            return
        speaks = self.strategy.rank == 0  # shard 0 speaks for the shards
        folder = self._choose(speaks)
        if folder is not None:
            manifest = CheckpointStore.read_manifest(folder)
            check_signature(folder, manifest, self._signature, self.strategy.reshards)
            saved_parts = manifest["part_names"]
            if saved_parts == self._signature["part_names"]:
                self.strategy.load_state_dict(CheckpointStore.read_part(folder, self._part, manifest))
            else:  # split into another number of parts: every part holds some of this one's
                self.strategy.server.load_resharded_state(
                    [CheckpointStore.read_part(folder, part, manifest) for part in saved_parts]
                )
                if speaks:
                    console.print(
                        f"paratrain: {folder} was written by {len(saved_parts)} ps shards, this run has "
                        f"{len(self._signature['part_names'])}: the parameters and optimizer state are resharded"
                    )
            self.restored_step = self._last_saved = int(manifest["step"])
            self._clear_after(speaks)
        self.strategy.server.announce_resume(str(folder) if folder is not None else None)

    def on_version(self, version: int) -> None:
        """A shard published ``version`` (its state is that version's), or a worker received it."""
        if self._part is not None and version % self.every_steps == 0:
            self._save_served(self.strategy.state_dict())
        elif self._part is None:
            self._save_beside(version)

    def on_serve_end(self, logs: dict[str, Any]) -> None:
        """The end of training on a shard: save the final version, finish the last commit."""
        state = self.strategy.state_dict()
        if state["version"] != self._last_saved:
            self._save_served(state)
        if self._committing is not None:
            self._committing.join(self._timeout())
            self._committing = None

    def _save_served(self, state: dict[str, Any]) -> None:
        """Write this shard's part of the version ``state`` holds; shard 0 commits the
        checkpoint from a background thread once the other shards' parts are there, so
        serving goes on."""
        version = state["version"]
        self.store.write_part(version, self._part, state)
        self._last_saved = version
        if self.strategy.rank == 0:
            if self._committing is not None:
                self._committing.join()
            self._committing = threading.Thread(
                target=self._commit_quietly,
                args=(version, dict(self._signature)),
                name="checkpoint-commit",
                daemon=True,
            )
            self._committing.start()

    def _commit_quietly(self, step: int, signature: dict[str, Any]) -> None:
        try:
            self.store.commit(step, signature["part_names"], signature, self._timeout())
        except (RuntimeError, ConfigError) as error:  # the previous checkpoint stays the newest
            console.print(f"paratrain: {error}", style="red")

    def _save_beside(self, version: int | None, final: bool = False) -> None:
        """A parameter-server worker's own state (its codec's), written beside each checkpoint
        the shards have written since it last saved (every ``every_steps`` versions, and the
        final one): in ps-sync exactly the state of that version; in ps-async and ps-backup
        that of the first version after it that this worker saw. Outside the manifest: a
        checkpoint without it resumes with that state empty, and says so."""
        if not self._keeps_own_state:
            return
        if version is None:  # the end: the version of the state as it is now
            version = self.strategy.state_dict()["version"]
        every, saved = self.every_steps, max(self._last_saved, 0)
        marks = list(range((saved // every + 1) * every, version + 1, every))
        if final and version > saved and version not in marks:
            marks.append(version)
        if not marks:
            return
        state = self.strategy.state_dict()
        for mark in marks:
            self.store.write_part(mark, self._beside_name, state)
        self._last_saved = version

    @property
    def _keeps_own_state(self) -> bool:
        """Whether this parameter-server worker keeps state of its own (a codec with state)."""
        if self._own_state is None:
            self._own_state = bool(self.strategy.state_dict())
        return self._own_state

    @property
    def _beside_name(self) -> str:
        return f"worker-{self.strategy.rank}"

    # ----- saving and restoring -----------------------------------------------------------------
    def save(self, step: int) -> None:
        """Write this process's part of step ``step``; on the chief, commit the checkpoint."""
        part = self._part
        if part is None or step == self._last_saved:
            return
        trainer = self.trainer
        trainer.check_finite()  # never save a model that has diverged
        state: dict[str, Any] = {"trainer": trainer.state_dict(), "strategy": self.strategy.state_dict()}
        folder = self.store.folder(step)
        self.store._makedirs(folder)
        files = self.strategy.model_files
        own_files = files.save_model(trainer.module, trainer.optimizer, folder) if files is not None else None
        if own_files is None and self._model_part == part:
            state["model"] = trainer.module.state_dict()
            state["optimizer"] = trainer.optimizer.state_dict()
        self.store.write_part(step, part, state)
        self._last_saved = step
        if self.strategy.is_chief:
            parts = self.strategy.topology.checkpoint_parts() + (own_files or [])
            self.store.commit(step, parts, self.signature(), self._timeout())

    def restore(self) -> None:
        """Load the newest complete checkpoint into this process (nothing if there is none)."""
        if self._part is None:  # a parameter-server worker: the shards chose the checkpoint
            self._resume_elsewhere()
            return
        speaks = self.strategy.is_chief
        folder = self._choose(speaks)
        if folder is None:
            return
        manifest = CheckpointStore.read_manifest(folder)
        reshards = self.strategy.reshards
        check_signature(folder, manifest, self.signature(), reshards)
        part, model_part = self._part, self._model_part
        if reshards and part not in manifest["parts"]:  # a replica the saving run did not have
            part = model_part = "rank-0"
        device = self.strategy.device
        own = CheckpointStore.read_part(folder, part, manifest, map_location=device)
        if model_part is not None:
            held = (
                own
                if model_part == part
                else CheckpointStore.read_part(folder, model_part, manifest, map_location=device)
            )
            self._load_model(folder, held, manifest)
        saved_replicas, replicas = manifest.get("workers"), self.strategy.num_replicas
        strategy_state = own["strategy"]
        if reshards:
            strategy_state = self.strategy.reshard_state(strategy_state, int(saved_replicas))
        self.strategy.load_state_dict(strategy_state)
        self.trainer.load_state_dict(own["trainer"])
        if reshards and saved_replicas != replicas:
            self.trainer.carry_position(int(saved_replicas), replicas)
            if speaks:
                console.print(
                    f"paratrain: {folder} was written by {saved_replicas} replicas, this run has {replicas}: "
                    f"the model is resharded and epoch {self.trainer.epoch + 1} goes on at batch {self.trainer.batch}"
                )
        self.restored_step = self._last_saved = int(manifest["step"])
        self._clear_after(speaks)
        if speaks:
            console.print(f"paratrain: resumed from {folder} (step {self.restored_step})")

    def _choose(self, speaks: bool) -> Path | None:
        """The newest complete checkpoint (None: start afresh); the process that ``speaks``
        for the run names the corrupt ones newer than it, or says none is complete."""
        folder, corrupt = self.store.resume_from()
        if speaks:
            for line in corrupt:
                console.print(f"paratrain: {line}")
            if folder is None and self.store.root.is_dir() and any(self.store.root.iterdir()):
                console.print(f"paratrain: no complete checkpoint in {self.store.root}; training from the start")
        return folder

    def _clear_after(self, speaks: bool) -> None:
        """The process that ``speaks`` for the run moves corrupt checkpoints newer than the
        restored one aside, before a save writes their steps again."""
        if speaks:
            for aside in self.store.clear_after(self.restored_step):
                console.print(f"paratrain: moved the corrupt checkpoint aside to {aside}")

    def _resume_elsewhere(self) -> None:
        """A process whose state another holds (a parameter-server worker: the shards) goes
        on from the checkpoint they took, where they say; its own state, if it keeps any, is
        in its file beside. Shards and workers never pick a checkpoint each: a slow worker
        could find one the resumed shards have written since."""
        remote = self.strategy.remote
        position = remote.resume_position() if remote is not None else None
        if position is None or position["folder"] is None:
            return  # the shards start afresh
        folder = Path(position["folder"])
        manifest = CheckpointStore.read_manifest(folder)
        self.trainer.global_step, self.trainer.epoch = position["global_step"], position["epoch"]
        self.restored_step = self._last_saved = int(manifest["step"])
        saved_workers, workers = manifest.get("workers"), self.strategy.describe()["workers"]
        if self.strategy.is_chief:
            if saved_workers != workers:
                console.print(
                    f"paratrain: {folder} was written by a run with {saved_workers} workers, this one has "
                    f"{workers}: the shards go on with the workers there are"
                )
            console.print(f"paratrain: resumed from {folder} (step {self.restored_step})")
        if not self._keeps_own_state:
            return
        if manifest.get("ps_shards") != self.strategy.describe()["ps_shards"]:
            if self.strategy.is_chief:
                console.print(
                    f"paratrain: the workers' {self.strategy.codec.name} state was kept per shard of "
                    f"{manifest.get('ps_shards')}: it starts empty"
                )
            return
        state = CheckpointStore.read_extra(folder, self._beside_name, map_location="cpu")
        if state is None:
            console.print(
                f"paratrain: worker {self.strategy.rank}: {folder} holds no {self._beside_name}.pt; "
                f"its {self.strategy.codec.name} state starts empty"
            )
        else:
            self.strategy.load_state_dict(state)

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
