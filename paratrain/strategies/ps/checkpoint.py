"""A parameter-server run's checkpoints: what its shards and its workers write.

Each shard saves its slice of the parameters, its optimizer, its version and where the
epoch's batches stand, at every ``every_steps``-th version it publishes and at the end;
shard 0 commits the checkpoint from a background thread once every shard's part is
there, so serving goes on. On resume shard 0 picks the checkpoint, every shard loads its
part (or, written by another number of shards, its slice of all of them: reshard.py) and
the shards tell the workers where the run goes on. A worker never picks a checkpoint of
its own, since a slow worker could find one the resumed shards have written since; a
worker whose codec keeps state (error feedback, PowerSGD) writes that state beside the
checkpoints (``worker-<i>.pt``, outside the manifest): in ps-sync exactly that of the
version saved, in ps-async and ps-backup that of the first version after it the worker
saw. A checkpoint without it resumes with that state empty, and says so."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.checkpoints.files import RunCheckpoints
from paratrain.checkpoints.signature import check_signature
from paratrain.checkpoints.store import CheckpointStore
from paratrain.console import console

if TYPE_CHECKING:
    from paratrain.strategies.base import Strategy
    from paratrain.strategies.ps.host import ShardHost
    from paratrain.strategies.ps.worker import PSWorker
    from paratrain.strategies.roles import FitLoop


class ShardState:
    """The state writer of a parameter-server shard."""

    checks_fresh_folder = True  # a checkpoint needs every shard's part: none before all start

    def __init__(self, files: RunCheckpoints, strategy: Strategy, host: ShardHost):
        self.files = files
        self.strategy = strategy
        self.host = host
        self.part = strategy.topology.checkpoint_part(strategy.process_rank)
        self.signature = files.signature()

    @property
    def speaks(self) -> bool:
        return self.strategy.rank == 0  # shard 0 speaks for the shards

    def restore(self) -> None:
        files, strategy = self.files, self.strategy
        folder = files.choose(self.speaks)
        if folder is not None:
            manifest = CheckpointStore.read_manifest(folder)
            check_signature(folder, manifest, self.signature, reshards=True)
            saved_parts, parts = manifest["part_names"], self.signature["part_names"]
            own = CheckpointStore.read_part(folder, self.part, manifest) if saved_parts == parts else None
            if own is not None and self.host.holds_as_saved(own):
                strategy.load_state_dict(own)
            else:  # split into other parts: every part holds some of this one's
                self.host.load_resharded_state([CheckpointStore.read_part(folder, p, manifest) for p in saved_parts])
                if self.speaks:
                    how = (
                        f"by {len(saved_parts)} ps shards, this run has {len(parts)}"
                        if own is None
                        else "with another --table-sharding"
                    )
                    console.print(
                        f"paratrain: {folder} was written {how}: the parameters and optimizer state are resharded"
                    )
            files.restored(int(manifest["step"]), self.speaks)
        self.host.announce_resume(str(folder) if folder is not None else None)

    def at_step(self, step: int) -> None:
        """A shard takes no steps: it saves at versions."""

    def at_version(self, version: int) -> None:
        if version % self.files.every_steps == 0:
            self._save(self.strategy.state_dict())

    def at_end(self, step: int) -> None:
        state = self.strategy.state_dict()
        if state["version"] != self.files.last_saved:
            self._save(state)
        self.files.finish(self.files.timeout)

    def _save(self, state: dict[str, Any]) -> None:
        version = state["version"]
        self.files.store.write_part(version, self.part, state)
        self.files.last_saved = version
        if self.speaks:
            self.files.commit_in_background(version, self.signature)


class WorkerState:
    """The state writer of a parameter-server worker: where the shards resumed, and its
    codec's state beside their checkpoints."""

    checks_fresh_folder = False  # under ps-async the others may have pushed a checkpoint's versions

    def __init__(self, files: RunCheckpoints, strategy: Strategy, worker: PSWorker, loop: FitLoop, keeps_state: bool):
        self.files = files
        self.strategy = strategy
        self.worker = worker
        self.loop = loop
        self.keeps_state = keeps_state
        """Whether the worker's codec keeps state of its own (error feedback, PowerSGD)."""
        self.name = f"worker-{strategy.rank}"

    def restore(self) -> None:
        files, strategy = self.files, self.strategy
        position = self.worker.resume_position()
        if position["folder"] is None:
            return  # the shards start afresh
        folder = Path(position["folder"])
        manifest = CheckpointStore.read_manifest(folder)
        self.loop.global_step, self.loop.epoch = position["global_step"], position["epoch"]
        files.restored_step = files.last_saved = int(manifest["step"])
        facts = strategy.describe()
        if strategy.is_chief:
            if manifest.get("workers") != facts["workers"]:
                console.print(
                    f"paratrain: {folder} was written by a run with {manifest.get('workers')} workers, this one has "
                    f"{facts['workers']}: the shards go on with the workers there are"
                )
            console.print(f"paratrain: resumed from {folder} (step {files.restored_step})")
        if not self.keeps_state:
            return
        if manifest.get("ps_shards") != facts["ps_shards"]:
            if strategy.is_chief:
                console.print(
                    f"paratrain: the workers' {facts['compression']} state was kept per shard of "
                    f"{manifest.get('ps_shards')}: it starts empty"
                )
            return
        state = CheckpointStore.read_extra(folder, self.name, map_location="cpu")
        if state is None:
            console.print(
                f"paratrain: worker {strategy.rank}: {folder} holds no {self.name}.pt; "
                f"its {facts['compression']} state starts empty"
            )
        else:
            strategy.load_state_dict(state)

    def at_step(self, step: int) -> None:
        """The shards hold the run's state at steps: nothing of the worker's own."""

    def at_version(self, version: int) -> None:
        self._save_beside(version, final=False)

    def at_end(self, step: int) -> None:
        self._save_beside(None, final=True)

    def _save_beside(self, version: int | None, final: bool) -> None:
        """The codec's state, beside each checkpoint the shards have written since this
        worker last saved (every ``every_steps`` versions, and at the end the final one)."""
        if not self.keeps_state:
            return
        state = self.strategy.state_dict()
        if version is None:  # the end: the version of the state as it is now
            version = state["version"]
        every, saved = self.files.every_steps, max(self.files.last_saved, 0)
        marks = list(range((saved // every + 1) * every, version + 1, every))
        if final and version > saved and version not in marks:
            marks.append(version)
        if not marks:
            return
        for mark in marks:
            self.files.store.write_extra(mark, self.name, state)
        self.files.last_saved = version
