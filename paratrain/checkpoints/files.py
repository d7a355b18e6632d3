"""What every process's state writer shares: the run's checkpoint folder, how often it saves, the signature it
writes and checks, and which checkpoint the run resumed from.

A ``StateWriter`` is the part of checkpointing that depends on what a process holds (a training replica:
train/checkpoint.py; a PS shard or worker: strategies/ps/checkpoint.py); the ``Checkpoint`` callback calls it
at the loop's events and writers never call the loop. A write may run in the background
(``RunCheckpoints.in_background``: a PS shard always, a replica with ``--checkpoint-async`` on a ``copy_state``
taken at the step). One write is under way at a time; the next save and the end of training wait for it
and raise what it raised.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from paratrain.checkpoints.store import CheckpointStore
from paratrain.console import console
from paratrain.errors import ConfigError


class StateWriter(Protocol):
    checks_fresh_folder: bool
    """Whether a run that does not resume refuses a folder holding complete checkpoints
    when this writer starts (``CheckpointStore.refuse_to_start_over``): True where no
    process of its own run can have committed one yet (every part needs every process);
    False where a peer may have (a fault-tolerant replica that starts late, a parameter
    server's worker that starts after others pushed), whose launcher checks instead."""

    def restore(self) -> None:
        """Load this process's part of the newest complete checkpoint (nothing if none)."""

    def at_step(self, step: int) -> None:
        """A training step ended that the run saves at (``every_steps``), or a stop asks for one."""

    def at_version(self, version: int) -> None:
        """A parameter version was published (a shard) or received (a worker)."""

    def at_end(self, step: int) -> None:
        """Training ended at ``step``: save the final state, finish any commit."""


class RunCheckpoints:
    """The checkpoints of one run as every writer of it sees them."""

    def __init__(
        self,
        store: CheckpointStore,
        every_steps: int,
        timeout: float,
        signature: Callable[[], dict],
        asynchronous: bool = False,
    ):
        self.store = store
        self.every_steps = every_steps
        self.timeout = timeout
        self.asynchronous = asynchronous
        """A training replica writes its part and commits from a thread (``--checkpoint-async``)."""
        self.signature = signature
        """The run's signature now (``signature.run_signature``)."""
        self.restored_step: int | None = None
        """The step of the checkpoint this run resumed from (None: it started afresh)."""
        self.last_saved = -1
        """The step (a parameter-server run: the version) this process saved last."""
        self._writing: threading.Thread | None = None
        self._failure: BaseException | None = None

    def choose(self, speaks: bool) -> Path | None:
        """The newest complete checkpoint (None: start afresh); the process that ``speaks``
        for the run names the corrupt ones newer than it, or says none is complete."""
        folder, corrupt = self.store.resume_from()
        if speaks:
            for line in corrupt:
                console.print(f"paratrain: {line}")
            if folder is None and self.store.root.is_dir() and any(self.store.root.iterdir()):
                console.print(f"paratrain: no complete checkpoint in {self.store.root}; training from the start")
        return folder

    def restored(self, step: int, speaks: bool, peers_write: bool = False) -> None:
        """The run goes on from the checkpoint of ``step``; the process that ``speaks``
        moves corrupt checkpoints newer than it aside, before a save writes their steps
        again, and removes unfinished saves unless live peers may be writing them
        (``peers_write``: a replica of a fault-tolerant run)."""
        self.restored_step = self.last_saved = step
        if speaks:
            for aside in self.store.clear_after(step, unfinished=not peers_write):
                console.print(f"paratrain: moved the corrupt checkpoint aside to {aside}")

    def in_background(self, work: Callable[[], None]) -> None:
        """Run ``work`` on a thread of its own once the write before it is done, and return;
        what it raises, the next ``finish`` raises."""
        self.finish(None)
        self._writing = threading.Thread(target=self._run, args=(work,), name="checkpoint-write", daemon=True)
        self._writing.start()

    def finish(self, timeout: float | None) -> None:
        """Wait for the write under way, if any (``timeout`` None: however long it takes;
        past ``timeout`` it is left to end alone), and raise here what it raised."""
        if self._writing is not None:
            self._writing.join(timeout)
            self._writing = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # the training thread raises it at its next save or its end
            self._failure = error

    def commit_in_background(self, step: int, signature: dict[str, Any]) -> None:
        """Commit ``step`` once every part named in ``signature`` is there, from a thread,
        so that the caller goes on (a shard serving); one write at a time."""
        self.in_background(functools.partial(self._commit_quietly, step, dict(signature)))

    def _commit_quietly(self, step: int, signature: dict[str, Any]) -> None:
        try:
            self.store.commit(step, signature["part_names"], signature, self.timeout)
        except (RuntimeError, ConfigError) as error:  # the previous checkpoint stays the newest
            console.print(f"paratrain: {error}", style="red")


def copy_state(state: Any, copies: dict[tuple, torch.Tensor] | None = None) -> Any:
    """``state`` (nested dicts, lists and tuples) with every tensor copied to the CPU, so
    that training may go on changing the originals while the copy is written; one view of
    one storage met twice (tied weights: ``state_dict`` gives them as two detached tensors
    of one storage) is copied once and stays shared in the copy, as ``torch.save`` keeps it."""
    copies = {} if copies is None else copies
    if isinstance(state, torch.Tensor):
        view = (
            state.device,
            state.untyped_storage().data_ptr(),
            state.storage_offset(),
            state.dtype,
            tuple(state.shape),
            tuple(state.stride()),
        )
        if view not in copies:
            copies[view] = state.detach().to("cpu", copy=True)
        return copies[view]
    if isinstance(state, dict):
        return {key: copy_state(value, copies) for key, value in state.items()}
    if isinstance(state, list):
        return [copy_state(value, copies) for value in state]
    if isinstance(state, tuple):
        items = [copy_state(value, copies) for value in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)  # a named tuple, or a plain one
    return state
