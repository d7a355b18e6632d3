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

import hashlib
import io
import json
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.timeline import span
from paratrain.train.callbacks import Callback

if TYPE_CHECKING:
    from paratrain.strategies.base import Strategy

FORMAT = "paratrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointStore:
    """The checkpoints of one folder: write parts, commit them with a manifest, find the
    newest complete one, read parts back, and keep the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 5):
        self.root = Path(directory).expanduser()
        self.keep = keep

    def folder(self, step: int) -> Path:
        return self.root / f"ckpt-{step:09d}"

    # ----- writing ----------------------------------------------------------------------------
    def write_part(self, step: int, part: str, state: dict[str, Any]) -> Path:
        folder = self.folder(step)
        self._makedirs(folder)
        path = folder / f"{part}.pt"
        with span("checkpoint"):
            # Serialised first: a failing write (a full disk) then reports the system's reason.
            buffer = io.BytesIO()
            torch.save(state, buffer)
            self._write_atomic(path, lambda handle: handle.write(buffer.getbuffer()))
        return path

    def commit(self, step: int, parts: list[str], meta: dict[str, Any], timeout: float) -> Path:
        """Wait (up to ``timeout`` s) for every part of ``step``, then write the manifest
        that makes the checkpoint complete, and drop the checkpoints beyond ``keep``."""
        folder = self.folder(step)
        deadline = time.monotonic() + timeout
        missing = [p for p in parts if not (folder / f"{p}.pt").exists()]
        while missing and time.monotonic() < deadline:
            time.sleep(0.01)
            missing = [p for p in missing if not (folder / f"{p}.pt").exists()]
        if missing:
            raise RuntimeError(
                f"checkpoint {folder}: the part of {', '.join(missing)} did not arrive within {timeout:g} s"
            )
        files = {p: _describe_file(folder / f"{p}.pt") for p in parts}
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            **meta,
            "parts": files,
        }
        text = json.dumps(manifest, indent=2).encode()
        self._write_atomic(folder / MANIFEST, lambda handle: handle.write(text))
        self.prune()
        return folder

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; remove older ones, and incomplete
        folders older than the newest complete one (left by a crash mid-save)."""
        complete = self.complete()
        if not complete:
            return
        newest = complete[0][0]
        for _, folder in complete[self.keep :]:
            shutil.rmtree(folder, ignore_errors=True)
        done = {step for step, _ in complete}
        for step, folder in self._folders():
            if step < newest and step not in done:
                shutil.rmtree(folder, ignore_errors=True)

    def clear_after(self, step: int) -> None:
        """Remove incomplete folders after ``step``: what a run that died mid-save left,
        before its resumed run writes those steps again."""
        done = {s for s, _ in self.complete()}
        for later, folder in self._folders():
            if later > step and later not in done:
                shutil.rmtree(folder, ignore_errors=True)

    def _makedirs(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"checkpoint directory {folder}: {error.strerror}") from None

    def _write_atomic(self, path: Path, write: Callable[[Any], Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            _fsync_folder(path.parent)
        except OSError as error:
            Path(tmp).unlink(missing_ok=True)
            reason = error.strerror or str(error)
            raise ConfigError(f"checkpoint {path}: cannot write ({reason}); the earlier checkpoints are kept") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # ----- reading ----------------------------------------------------------------------------
    def _folders(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for folder in self.root.glob("ckpt-*"):
            suffix = folder.name.removeprefix("ckpt-")
            if folder.is_dir() and suffix.isdigit():
                found.append((int(suffix), folder))
        return sorted(found, reverse=True)

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, newest first."""
        return [(step, folder) for step, folder in self._folders() if self._is_complete(folder)]

    def _is_complete(self, folder: Path) -> bool:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            return all((folder / f"{p}.pt").stat().st_size == f["bytes"] for p, f in manifest["parts"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def latest(self) -> Path | None:
        complete = self.complete()
        return complete[0][1] if complete else None

    @staticmethod
    def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
        folder = Path(folder)
        path = folder / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {folder}: no {MANIFEST}; not a complete paratrain checkpoint") from None
        except (OSError, ValueError) as error:
            raise ConfigError(f"checkpoint {folder}: unreadable {MANIFEST} ({error})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ConfigError(
                f"checkpoint {folder}: not a paratrain checkpoint (its {MANIFEST} has no format {FORMAT!r})"
            )
        if manifest.get("version") != FORMAT_VERSION:
            raise ConfigError(
                f"checkpoint {folder}: format version {manifest.get('version')}, this paratrain reads {FORMAT_VERSION}"
            )
        return manifest

    @staticmethod
    def read_extra(folder: str | os.PathLike, name: str, map_location: Any = "cpu") -> dict[str, Any] | None:
        """A file a process writes beside the parts at its own pace (``name``.pt), outside
        the manifest: None where there is none."""
        path = Path(folder) / f"{name}.pt"
        if not path.exists():
            return None
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise ConfigError(f"checkpoint {path}: not a readable checkpoint ({str(error).splitlines()[0]})") from None

    @staticmethod
    def read_part(
        folder: str | os.PathLike, part: str, manifest: dict[str, Any], map_location: Any = "cpu"
    ) -> dict[str, Any]:
        """One part, checked against the manifest's size and SHA-256, loaded with weights_only."""
        folder = Path(folder)
        path = folder / f"{part}.pt"
        expected = manifest["parts"].get(part)
        if expected is None:
            raise ConfigError(f"checkpoint {folder}: has no part {part!r} (it has {', '.join(manifest['parts'])})")
        try:
            found = _describe_file(path)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {folder}: part {path.name} is missing") from None
        if found != expected:
            raise ConfigError(
                f"checkpoint {path}: corrupt or truncated ({found['bytes']} bytes, SHA-256 {found['sha256'][:12]}...; "
                f"the manifest says {expected['bytes']} bytes, {expected['sha256'][:12]}...)"
            )
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise ConfigError(f"checkpoint {path}: not a readable checkpoint ({str(error).splitlines()[0]})") from None


def _describe_file(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def check_signature(folder: Path, manifest: dict[str, Any], signature: dict[str, Any]) -> None:
    differ = [key for key in signature if manifest.get(key) != signature[key]]
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
        folder = self.store.latest() if self.resume else None
        if folder is not None:
            manifest = CheckpointStore.read_manifest(folder)
            check_signature(folder, manifest, self._signature)
            self.strategy.load_state_dict(CheckpointStore.read_part(folder, self._part, manifest))
            self.restored_step = int(manifest["step"])
            self._last_saved = self.restored_step

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
            self._committing.join(60.0)
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
        if self._model_part == part:
            state["model"] = trainer.module.state_dict()
            state["optimizer"] = trainer.optimizer.state_dict()
        self.store.write_part(step, part, state)
        self._last_saved = step
        if self.strategy.is_chief:
            self.store.commit(step, self.strategy.topology.checkpoint_parts(), self.signature(), self._timeout())

    def restore(self) -> None:
        """Load the newest complete checkpoint into this process (nothing if there is none)."""
        folder = self.store.latest()
        if folder is None:
            if self.store.root.is_dir() and any(self.store.root.iterdir()) and self.strategy.is_chief:
                console.print(f"paratrain: no complete checkpoint in {self.store.root}; training from the start")
            return
        manifest = CheckpointStore.read_manifest(folder)
        check_signature(folder, manifest, self.signature())
        part, model_part = self._part, self._model_part
        device = self.strategy.device
        own = CheckpointStore.read_part(folder, part, manifest, map_location=device) if part is not None else None
        if model_part is not None:
            held = (
                own
                if model_part == part
                else CheckpointStore.read_part(folder, model_part, manifest, map_location=device)
            )
            self._load_model(folder, held)
        if own is not None:
            self.strategy.load_state_dict(own["strategy"])
            self.trainer.load_state_dict(own["trainer"])
        else:  # the state is the servers' (parameter-server workers): they say where to go on
            self._resume_elsewhere(folder)
        self.restored_step = int(manifest["step"])
        self._last_saved = self.restored_step
        if self.strategy.is_chief:
            self.store.clear_after(self.restored_step)
            console.print(f"paratrain: resumed from {folder} (step {self.restored_step})")

    def _resume_elsewhere(self, folder: Path) -> None:
        """A process whose state another holds (a parameter-server worker: the shards) goes
        on where the strategy says; its own state, if it keeps any, is in its file beside."""
        position = self.strategy.resume_position()
        self.trainer.global_step, self.trainer.epoch = position["global_step"], position["epoch"]
        if not self._keeps_own_state:
            return
        state = CheckpointStore.read_extra(folder, self._beside_name, map_location="cpu")
        if state is None:
            console.print(
                f"paratrain: worker {self.strategy.rank}: {folder} holds no {self._beside_name}.pt; "
                f"its {self.strategy.codec.name} state starts empty"
            )
        else:
            self.strategy.load_state_dict(state)

    def _load_model(self, folder: Path, state: dict[str, Any]) -> None:
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
