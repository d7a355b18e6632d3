"""The checkpoints of one folder on disk: parts written atomically, a manifest that makes
them one checkpoint, and reading them back checked (the format: docs/checkpoints.md)."""

from __future__ import annotations

import functools
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
from typing import Any

import torch

from paratrain.checkpoints.manifest_fields import MANIFEST, check_fields, refuse_outside
from paratrain.errors import ConfigError
from paratrain.timeline import COMPUTE, IO, span

FORMAT = "paratrain-checkpoint"
FORMAT_VERSION = 2
"""The version this paratrain writes. 2: the trainer's history is one JSON text (train/history.py)."""
READS = (1, 2)
"""The versions it reads: 1 holds the history as a list of dicts, which ``History.restored`` takes too."""


class CheckpointStore:
    """The checkpoints of one folder: write parts, commit them with a manifest, find the
    newest complete one, read parts back, and keep the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 5):
        self.root = Path(directory).expanduser()
        self.keep = keep

    def folder(self, step: int) -> Path:
        return self.root / f"ckpt-{step:09d}"

    # ----- writing ----------------------------------------------------------------------------
    def write_part(self, step: int, part: str, state: dict[str, Any], save: str | None = None) -> Path:
        """Write one part of checkpoint ``step``, its SHA-256 noted beside it for the commit
        (with ``save``, the token of the save it belongs to: ``commit`` then waits for it)."""
        return self._write_state(self.folder(step) / f"{part}.pt", state, noted=True, save=save)

    def write_extra(self, step: int, name: str, state: dict[str, Any]) -> Path:
        """Write a file beside the parts of checkpoint ``step``, outside its manifest (``read_extra``)."""
        return self._write_state(self.folder(step) / f"{name}.pt", state, noted=False)

    def _write_state(self, path: Path, state: dict[str, Any], noted: bool, save: str | None = None) -> Path:
        self._makedirs(path.parent)
        # On the training thread a save is one of its phases; from a thread of its own
        # (--checkpoint-async) it overlaps them: on the io track.
        with span("checkpoint", COMPUTE if threading.current_thread() is threading.main_thread() else IO):
            # Serialised first: a failing write (a full disk) then reports the system's reason.
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getbuffer()
            note = None
            if noted:  # hashed here, from memory, so that the commit need not read the file
                digest = hashlib.sha256(data).hexdigest()
                note = functools.partial(_note_digest, path, digest, save)
            self._write_atomic(path, lambda handle: handle.write(data), note)
        return path

    def commit(
        self, step: int, parts: list[str], meta: dict[str, Any], timeout: float, save: str | None = None
    ) -> Path:
        """Wait (up to ``timeout`` s) for every part of ``step`` (with ``save``, the file its
        writer noted with that token, never one a save cut short by a crash left), then
        write the manifest that makes the checkpoint complete, and prune to ``keep``."""
        folder = self.folder(step)
        deadline = time.monotonic() + timeout

        def arrived(part: str) -> bool:
            if save is None or "/" in part:  # a mode's own files are written before the commit
                return part_path(folder, part).exists()
            return _noted_by(folder, part, save)

        missing = [p for p in parts if not arrived(p)]
        while missing and time.monotonic() < deadline:
            time.sleep(0.01)
            missing = [p for p in missing if not arrived(p)]
        if missing:
            raise RuntimeError(
                f"checkpoint {folder}: the part of {', '.join(missing)} did not arrive within {timeout:g} s"
            )
        files = {p: _described(folder, p) for p in parts}
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
        for part in parts:
            digest_path(part_path(folder, part)).unlink(missing_ok=True)
        self.prune()
        return folder

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; remove older complete ones, and
        folders without a manifest older than the newest complete one (a save that a crash
        cut short). A folder whose manifest exists but does not check out is corruption,
        not an unfinished save: it is never removed."""
        complete = self.complete()
        if not complete:
            return
        newest = complete[0][0]
        for _, folder in complete[self.keep :]:
            shutil.rmtree(folder, ignore_errors=True)
        for step, folder in self._folders():
            if step < newest and not (folder / MANIFEST).exists():
                shutil.rmtree(folder, ignore_errors=True)

    def clear_after(self, step: int, unfinished: bool = True) -> list[Path]:
        """Before a resumed run writes the steps after ``step`` again: remove the unfinished
        saves after it (``unfinished``), and move corrupt checkpoints after it aside
        (``ckpt-N.corrupt``), never deleting them. Returns where those went.

        ``unfinished`` False where a live peer may be writing one of those saves now (a
        fault-tolerant replica resuming beside a replica that resumed sooner): they are
        left to it, and a save cut short is removed by ``prune`` once a later one completes."""
        moved = []
        for later, folder in self._folders():
            if later <= step or self.problem(folder) is None:
                continue
            if not (folder / MANIFEST).exists():
                if unfinished:
                    shutil.rmtree(folder, ignore_errors=True)
                continue
            aside = folder.with_name(f"{folder.name}.corrupt")
            n = 1
            while aside.exists():
                aside, n = folder.with_name(f"{folder.name}.corrupt-{n}"), n + 1
            folder.rename(aside)
            moved.append(aside)
        return moved

    def _makedirs(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"checkpoint directory {folder}: {error.strerror}") from None

    def _write_atomic(
        self, path: Path, write: Callable[[Any], Any], written: Callable[[os.stat_result], None] | None = None
    ) -> None:
        """``write`` to a temporary file beside ``path``, synced, then renamed to ``path``;
        ``written`` is handed the synced file's status before the rename."""
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
                if written is not None:
                    written(os.fstat(handle.fileno()))
            os.replace(tmp, path)
            _fsync_folder(path.parent)
        except BaseException as error:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if not isinstance(error, OSError):
                raise
            reason = error.strerror or str(error)
            raise ConfigError(f"checkpoint {path}: cannot write ({reason}); the earlier checkpoints are kept") from None

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
        return [(step, folder) for step, folder in self._folders() if self.problem(folder) is None]

    def problem(self, folder: Path) -> str | None:
        """What keeps ``folder`` from being a complete checkpoint (None: nothing): no manifest
        (a save not finished), or a manifest that does not read or does not match its parts."""
        path = folder / MANIFEST
        if not path.exists():
            return f"no {MANIFEST} (a save that did not finish)"
        try:
            manifest = json.loads(path.read_text())
            parts = manifest["parts"].items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return f"unreadable {MANIFEST} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        refuse_outside(folder, manifest)  # crafted, not corrupt: refused, never moved aside
        for part, described in parts:
            path = part_path(folder, part)
            try:
                size = path.stat().st_size
            except OSError:
                return f"part {path.relative_to(folder)} is missing"
            expected = described.get("bytes") if isinstance(described, dict) else described
            if size != expected:
                return f"part {path.relative_to(folder)} has {size} bytes, the manifest says {expected}"
        return None

    def refuse_to_start_over(self) -> None:
        """ConfigError where a run that does not resume would write into a folder holding
        complete checkpoints: its own would be pruned by step number beside them, and a
        restart would resume the earlier run's."""
        complete = self.complete()
        if complete:
            raise ConfigError(
                f"--checkpoint-dir {self.root} holds the checkpoints of an earlier run (the newest at step "
                f"{complete[0][0]}): go on from it with --resume (Checkpoint(resume=True)), or give another folder"
            )

    def latest(self) -> Path | None:
        complete = self.complete()
        return complete[0][1] if complete else None

    def resume_from(self) -> tuple[Path | None, list[str]]:
        """The checkpoint a resumed run starts from (None: start afresh, nothing was saved
        or only unfinished saves were), and a line for each corrupt checkpoint newer than it.
        ConfigError when checkpoints were written but none is readable, naming the newest
        and what is wrong with it: training from the start would lose them."""
        complete = self.latest()
        newer_step = int(complete.name.removeprefix("ckpt-")) if complete else -1
        corrupt = []
        for step, folder in self._folders():
            if step <= newer_step or not (folder / MANIFEST).exists():
                continue
            corrupt.append((folder, self.problem(folder)))
        if corrupt and complete is None:
            folder, problem = corrupt[0]
            raise ConfigError(
                f"--resume: no checkpoint in {self.root} reads; the newest, {folder.name}, has {problem}. "
                "Nothing was changed there; give another --checkpoint-dir to start afresh"
            )
        return complete, [f"checkpoint {folder} is corrupt ({problem}); it is kept" for folder, problem in corrupt]

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
        if manifest.get("version") not in READS:
            raise ConfigError(
                f"checkpoint {folder}: format version {manifest.get('version')}, this paratrain reads "
                f"{' and '.join(map(str, READS))}"
            )
        if not isinstance(manifest.get("parts"), dict):
            raise ConfigError(
                f"checkpoint {folder}: its {MANIFEST} lists no parts; not a complete paratrain checkpoint"
            )
        refuse_outside(folder, manifest)
        check_fields(folder, manifest)
        return manifest

    @staticmethod
    def check_files(folder: str | os.PathLike, manifest: dict[str, Any]) -> None:
        """The manifest's files in subfolders (a mode's own files: fsdp's sharded model)
        checked against their sizes and SHA-256; ConfigError naming the first that differs."""
        folder = Path(folder)
        for part, expected in manifest["parts"].items():
            if "/" not in part:
                continue
            try:
                found = _describe_file(folder / part)
            except FileNotFoundError:
                raise ConfigError(f"checkpoint {folder}: file {part} is missing") from None
            if found != expected:
                raise ConfigError(
                    f"checkpoint {folder / part}: corrupt or truncated (its SHA-256 differs from the manifest's)"
                )

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


def part_path(folder: Path, part: str) -> Path:
    """Where part ``part`` lives: ``rank-0`` -> ``rank-0.pt``; a name with a folder in it
    (a mode's own files, ``model/__0_0.distcp``) is that file."""
    return folder / part if "/" in part else folder / f"{part}.pt"


def digest_path(path: Path) -> Path:
    """Where the writer of the file at ``path`` notes its SHA-256 for the commit."""
    return path.with_name(f".{path.name}.sha256")


def _note_digest(path: Path, digest: str, save: str | None, written: os.stat_result) -> None:
    """Note ``digest``, the SHA-256 of the file about to be renamed to ``path``, with what
    tells that file apart (inode, size, modification time: a rename keeps them), so that
    the commit need not read the file again, and the token of the ``save`` it belongs to.
    Written before the rename, so the note is there when the file is; not synced: the
    manifest is what a crash must find whole."""
    note = {"sha256": digest, "file": [written.st_ino, written.st_size, written.st_mtime_ns], "save": save}
    tmp = digest_path(path).with_name(f"{digest_path(path).name}.{os.getpid()}")
    tmp.write_text(json.dumps(note))
    os.replace(tmp, digest_path(path))


def _note_of(path: Path) -> dict[str, Any] | None:
    """The writer's note of the file at ``path`` where it is of that very file in place
    (None: no note, one that does not read, or one of another file)."""
    try:
        note = json.loads(digest_path(path).read_text())
        found = path.stat()
        if note["file"] == [found.st_ino, found.st_size, found.st_mtime_ns]:
            return note
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _noted_by(folder: Path, part: str, save: str) -> bool:
    """Whether the file of ``part`` in place is the one its writer noted for ``save``."""
    note = _note_of(part_path(folder, part))
    return note is not None and note.get("save") == save


def _described(folder: Path, part: str) -> dict[str, Any]:
    """A part's size and SHA-256 for the manifest: from its writer's note where the note is
    of this very file, else read from the file (a mode's own files, a part put there by hand)."""
    path = part_path(folder, part)
    note = _note_of(path)
    if note is not None and isinstance(note.get("sha256"), str):
        return {"bytes": note["file"][1], "sha256": note["sha256"]}
    return _describe_file(path)


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
