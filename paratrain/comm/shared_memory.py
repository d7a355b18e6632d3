"""An all-reduce through shared memory, for the processes of a run that share one machine.

Gloo all-reduces over TCP even on loopback, where a small model's gradient costs more than its step; here,
as TensorFlow's MirroredStrategy sums in one process's memory, each process copies its gradient into its
slot of a /dev/shm file, sums its share of the positions over every slot in rank order, and copies the sums
back, between barriers. With 2 processes the result equals Gloo's sum to the bit. Used only where every
process shares the host name, boot, network and PID namespace, and on x86-64 only (its stores are seen in
order, which the barriers rely on). A dead peer is named within milliseconds (looked up in /proc), a hung
one after ``timeout`` seconds. ``shared_memory=False`` (``--no-shared-memory``) for a process with its own DDP
hook. Fault-tolerant runs make one per quorum (quorum_group.py); ``leave`` and ``watch`` let a peer that moved
on, or that the Lighthouse no longer hears, fail the sum. docs/allreduce.md has more.
"""

from __future__ import annotations

import os
import pickle
import platform
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain import timeline
from paratrain.proc_stat import started

FOLDER = Path("/dev/shm")
CHUNK_BYTES = 4 << 20
"""Bytes of one process's slot: a larger bucket goes through in pieces of this size."""
FLAG_STRIDE = 8
"""int64 counters between two processes' barrier counters: one 64-byte cache line each."""
SPIN = 64
"""Polls of the counters before a waiting process starts to yield its core."""
LOOK_S = 0.005
"""Seconds between two looks of a waiting process at the peers it waits on (/proc, the clock)."""


def host_identity() -> tuple[str, ...]:
    """What two processes of one machine, and of one network and PID namespace, have alike."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return socket.gethostname(), boot, os.readlink("/proc/self/ns/net"), os.readlink("/proc/self/ns/pid")


class SharedMemoryAllReduce:
    """The in-place sum of a tensor over the processes of one machine (``create``)."""

    def __init__(self, memory: torch.Tensor, rank: int, size: int, timeout: float, peers: list[tuple[int, str]] | None):
        header = _header(size)
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.peers = peers
        """Each process's pid and start time (/proc), by rank; None where /proc does not show
        them all to this process (mounted with ``hidepid``): a peer gone is then named after
        the timeout, as one that hangs."""
        self.memory = memory  # the mapping: the views below keep it
        lines = _lines(memory, size)
        self.counters = lines[:size]
        self.left = _left_flags(lines, size)
        """1 where that process has left this buffer (``leave``): it takes part in no more sums."""
        self.watch: Callable[[], None] | None = None
        """Called at each look of a waiting barrier: raises to end the wait (the caller's own check)."""
        self.slots = memory[header:].view(2, size, CHUNK_BYTES)  # two sets: calls alternate
        self.calls = 0
        self.arrivals = 0

    @staticmethod
    def nbytes(size: int) -> int:
        return _header(size) + 2 * size * CHUNK_BYTES

    @classmethod
    def create(
        cls, group: Any = None, timeout: float = 60.0, gather: Gather | None = None
    ) -> SharedMemoryAllReduce | None:
        """Collective over ``group`` (a group of ``dist``; or ``gather``, a ``GroupGather`` over a
        group that ``dist`` does not know): on every process the same answer, one shared buffer,
        or None where a process is on another machine (or namespace), the machine is not
        x86-64, or /dev/shm cannot hold the buffer."""
        gather = gather or _DistGather(group)
        rank, size = gather.rank, gather.size
        path = FOLDER / f"paratrain-allreduce-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        memory = None
        try:
            identity = host_identity() if platform.machine() in ("x86_64", "AMD64") else None
        except OSError:
            identity = None
        nonce = uuid.uuid4().int >> 65  # in the file: a process that maps it reads the creator's
        if rank == 0 and identity is not None and _room(cls.nbytes(size)):
            memory = _map(path, cls.nbytes(size), create=True)
            if memory is not None:
                _nonce(memory, size).fill_(nonce)
        made = (str(path), nonce) if memory is not None else None
        seen = gather((identity, made, (os.getpid(), started(os.getpid()))))
        shared = seen[0][1] is not None and all(i == seen[0][0] and i is not None for i, _, _ in seen)
        try:
            if shared and rank != 0:
                memory = _map(Path(seen[0][1][0]), cls.nbytes(size), create=False)
            # Another /dev/shm (a container of its own) holds no such file, or another one
            same = memory is not None and int(_nonce(memory, size)) == seen[0][1][1] if shared else False
            # Whether /proc shows this process its peers, asked while none of them can have
            # left yet (each waits in the gather below for this one)
            peers = [peer for _, _, peer in seen]
            watched = peers if all(started(pid) == start for pid, start in peers) else None
            try:
                opened = gather(same)  # all mapped the one file
            except BaseException:
                if same:  # a peer whose gather ended has the buffer: its first sum fails at once
                    _left_flags(_lines(memory, size), size)[rank].fill_(1)
                raise
        finally:
            if rank == 0 and memory is not None:
                path.unlink(missing_ok=True)  # the mappings stay; nothing is left behind
        if not all(opened):
            return None
        return cls(memory, rank, size, timeout, watched)

    def leave(self) -> None:
        """Take part in no more sums of this buffer: a peer waiting for this process in one
        is told so (a RuntimeError) at its next look, instead of waiting out its timeout."""
        self.left[self.rank].fill_(1)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (contiguous) summed in place over the processes; every process calls
        this with tensors of the same size and dtype, in the same order. A RuntimeError when
        a peer is gone, has left, or did not come within the timeout; this process has then
        left too (its peers' sums fail as well, as all do after a collective failed)."""
        if int(self.left[self.rank]):
            raise RuntimeError("this process left the shared-memory all-reduce (an earlier sum of it failed)")
        raw = tensor.view(-1).view(torch.uint8)
        try:
            for start in range(0, raw.numel(), CHUNK_BYTES):
                self._piece(raw[start : start + CHUNK_BYTES], tensor.dtype)
        except BaseException:
            self.leave()
            raise
        return tensor

    def _piece(self, piece: torch.Tensor, dtype: torch.dtype) -> None:
        slots = self.slots[self.calls % 2]
        self.calls += 1
        length = piece.numel()
        slots[self.rank, :length].copy_(piece)
        self._barrier()
        values = slots[:, :length].view(dtype)  # (processes, elements)
        count = values.shape[1]
        low, high = count * self.rank // self.size, count * (self.rank + 1) // self.size
        if high > low:
            total = values[0, low:high]
            for other in range(1, self.size):
                total.add_(values[other, low:high])
        self._barrier()
        piece.copy_(slots[0, :length])
        # The next call writes the other set, so no process overwrites this one before
        # every process has copied the sums out of it (it passes that call's barriers first).

    def _barrier(self) -> None:
        self.arrivals += 1
        self.counters[self.rank].fill_(self.arrivals)
        polls = 0  # the first look after LOOK_S of waiting
        deadline = None
        looked = time.monotonic()
        while int(self.counters.min()) < self.arrivals:
            polls += 1
            if polls < SPIN:
                continue
            os.sched_yield()  # on a busy machine a yield can take a time slice: look by the clock
            if polls % 64 == 0 and (now := time.monotonic()) - looked >= LOOK_S:
                looked = now
                deadline = deadline or now + self.timeout
                behind = [r for r, c in enumerate(self.counters.tolist()) if c < self.arrivals]
                # a process that left, then exited, is named for leaving: the first of the two
                left = [r for r in behind if int(self.left[r])]
                if left:  # as a collective fails on a peer's aborted group
                    raise RuntimeError(
                        f"process{'es' if len(left) > 1 else ''} {', '.join(map(str, left))} left the shared-memory "
                        "all-reduce before this sum (gone on to another group)"
                    )
                peers = self.peers
                gone = [r for r in behind if started(peers[r][0]) != peers[r][1]] if peers else []
                if gone:  # as a collective fails on a closed socket
                    raise RuntimeError(
                        f"the shared-memory all-reduce lost process{'es' if len(gone) > 1 else ''} "
                        f"{', '.join(f'{r} (pid {peers[r][0]})' for r in gone)} of this machine, gone (exited or "
                        "killed)"
                    )
                if self.watch is not None:
                    self.watch()
                if now > deadline:
                    # A RuntimeError that says it timed out, as a collective's does: the
                    # strategy's diagnosis then names the workers that no longer answer.
                    raise RuntimeError(
                        f"the shared-memory all-reduce timed out after --timeout {self.timeout:g} s: "
                        f"process{'es' if len(behind) > 1 else ''} {', '.join(map(str, behind))} of this machine "
                        "did not reach it"
                    )


def _header(size: int) -> int:
    """Bytes before the slots: a cache line for each process's counter, one for the nonce,
    one for each process's left flag."""
    return (2 * size + 1) * FLAG_STRIDE * 8


class Gather:
    """Every process's picklable object, in rank order, gathered over a group (a collective)."""

    rank: int
    size: int

    def __call__(self, obj: Any) -> list[Any]:
        raise NotImplementedError


class _DistGather(Gather):
    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def __call__(self, obj: Any) -> list[Any]:
        seen: list[Any] = [None] * self.size
        dist.all_gather_object(seen, obj, group=self.group)
        return seen


class GroupGather(Gather):
    """The gather over a c10d process group object itself (torchft's, made per quorum), by
    its ``allgather`` of byte tensors: the lengths first, then the padded bytes."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def _all(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([out], [tensor]).wait()
        return out

    def __call__(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        lengths = [int(n) for n in self._all(torch.tensor([data.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: data.numel()] = data
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(self._all(padded), lengths)]  # noqa: S301 - the run's own processes


def _lines(memory: torch.Tensor, size: int) -> torch.Tensor:
    """The header's int64s, one a cache line: the counters, the nonce, the left flags."""
    return memory[: _header(size)].view(torch.int64)[::FLAG_STRIDE]


def _left_flags(lines: torch.Tensor, size: int) -> torch.Tensor:
    """Each process's left flag among the header's ``lines`` (``_lines``)."""
    return lines[size + 1 : 2 * size + 1]


def _nonce(memory: torch.Tensor, size: int) -> torch.Tensor:
    return _lines(memory, size)[size]


def _room(nbytes: int) -> bool:
    try:
        stat = os.statvfs(FOLDER)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes


def _map(path: Path, nbytes: int, create: bool) -> torch.Tensor | None:
    """The file mapped shared (made first where ``create``; else only one that exists)."""
    if not create and not path.exists():
        return None
    try:
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None


def shared_memory_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP checks the real annotations, not strings
    """A DDP communication hook: the bucket averaged over the processes through ``state``
    (divided first, then summed, as DDP's own all-reduce hook does)."""
    buffer = bucket.buffer()
    size = buffer.numel() * buffer.element_size()
    with timeline.span("allreduce", timeline.COMM, bucket=bucket.index(), bytes=size):  # it ends within the call
        state.all_reduce_(buffer.div_(state.size))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
