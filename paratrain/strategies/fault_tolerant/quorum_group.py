"""The gradient group of a quorum: torchft's reconfigurable Gloo group, whose rendezvous has a deadline of its
own, shorter than its collectives'.

torchft gives the group's store connection, rendezvous and collectives one timeout (``--timeout``), so a
member lost between the quorum and the rendezvous held every survivor for all of it. Here the rendezvous
fails after the Lighthouse's ``--replica-heartbeat-timeout`` plus a few seconds: the step is not committed and
the next quorum forms without the lost member; the collectives keep the whole ``--timeout``.
``sum_in_quorum`` also abandons a collective once the Lighthouse says a member is gone (peers.py); the
abandoned group is kept until its collective ends (dropping it would join the Gloo thread waiting in it).
Where every member runs on this machine, the quorum's sums go through a shared-memory buffer
(comm/shared_memory.py) instead of loopback TCP, which fails a sum as the Gloo group would.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from paratrain.comm.shared_memory import GroupGather, SharedMemoryAllReduce
from paratrain.errors import WorkerLost
from paratrain.strategies.fault_tolerant.peers import PeerWatch
from paratrain.strategies.fault_tolerant.replicas import torchft_modules

#: What a rendezvous may take beyond the Lighthouse's heartbeat timeout: the slowest member
#: of a loaded machine getting to its configure.
RENDEZVOUS_SLACK_S = 2.0


def rendezvous_timeout(timeout: float, heartbeat_timeout: float) -> timedelta:
    """The deadline of a quorum group's rendezvous: never longer than ``timeout``."""
    return timedelta(seconds=min(timeout, heartbeat_timeout + RENDEZVOUS_SLACK_S))


def quorum_group(timeout: timedelta, rendezvous: timedelta, shared_memory: bool = True) -> Any:
    """A torchft Gloo group (a Manager's ``pg``) whose rendezvous waits at most ``rendezvous``
    and whose collectives wait ``timeout``; with ``shared_memory``, a quorum whose members all
    run on this machine sums through shared memory (``shared``)."""
    base = torchft_modules().ProcessGroupGloo

    class QuorumGroupGloo(base):
        def __init__(self, timeout: timedelta):
            super().__init__(timeout=timeout)
            self.abandoned: list[Any] = []
            """Works of this quorum's group that were given up (their tensors with them)."""
            self.retired: list[tuple[Any, list[Any]]] = []
            """Groups of earlier quorums whose abandoned works have not ended yet."""
            self.shared: SharedMemoryAllReduce | None = None
            """The quorum's shared-memory sum, where its members all run on this machine."""
            self.via = {"shared memory": 0, "gloo": 0}
            """The quorum groups made, by what sums in them."""

        def configure(self, *args: Any, **kwargs: Any) -> None:
            self.leave_shared()
            self.retired = [(pg, works) for pg, works in self.retired if not all(w.is_completed() for w in works)]
            if self.abandoned:
                self.retired.append((self._pg, self.abandoned))
                self.abandoned = []
            # torchft connects to the quorum's store and rendezvouses with its own timeout:
            # the short one for that, then the collectives' on the group it made. The gathers
            # that make the shared buffer are the group's first collectives: every member
            # makes them right after the rendezvous (a member killed since fails them at once).
            collective, self._timeout = self._timeout, rendezvous
            try:
                super().configure(*args, **kwargs)
            finally:
                self._timeout = collective
            self._pg._get_backend(torch.device("cpu")).set_timeout(collective)
            if shared_memory:
                self.shared = SharedMemoryAllReduce.create(
                    timeout=collective.total_seconds(), gather=GroupGather(self._pg)
                )
            self.via["shared memory" if self.shared is not None else "gloo"] += 1

        def leave_shared(self) -> None:
            """Done with this quorum's shared buffer: its peers' sums waiting on this process end."""
            if self.shared is not None:
                self.shared.leave()
                self.shared = None

        def shutdown(self) -> None:
            self.leave_shared()
            super().shutdown()

    return QuorumGroupGloo(timeout=timeout)


#: How often a waiting collective looks at the clock and the Lighthouse, in seconds.
POLL_S = 0.05


def sum_in_quorum(manager: Any, group: Any, tensors: list[torch.Tensor], peers: PeerWatch | None, step: int) -> None:
    """Sum ``tensors`` over the quorum of ``manager`` (torchft's Manager, made with
    ``group``, a ``quorum_group``), in place. Never raises: an error, or a member that the
    Lighthouse no longer hears (``peers``; None: no such question) while the collective
    waits, is reported to the Manager, and the step is then not committed."""
    if manager.errored() is not None:
        return
    manager.wait_quorum()
    if not manager.is_participating():
        for tensor in tensors:
            tensor.zero_()
    shared = group.shared
    if shared is not None and all(t.device.type == "cpu" for t in tensors):
        _sum_shared(manager, shared, tensors, peers, step)
        return
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    works: list[Any] = []
    try:
        works.extend(group.allreduce([tensor], opts) for tensor in tensors)
        for work in works:
            _wait(work, peers, step)
    except Exception as error:  # the step is redone in a new quorum
        if isinstance(error, _Vanished):
            group.abandoned.extend(works)
        manager.report_error(error)


def _sum_shared(
    manager: Any, shared: SharedMemoryAllReduce, tensors: list[torch.Tensor], peers: PeerWatch | None, step: int
) -> None:
    """``sum_in_quorum`` through the quorum's shared buffer, with the same questions to the
    Lighthouse while a sum waits."""
    started = time.monotonic()
    shared.watch = lambda: _raise_if_lost(peers, step, started)
    try:
        for tensor in tensors:
            shared.all_reduce_(tensor)
    except Exception as error:  # the step is redone in a new quorum
        manager.report_error(error)


class _Vanished(WorkerLost):
    pass


def _raise_if_lost(peers: PeerWatch | None, step: int, started: float) -> None:
    """_Vanished when the Lighthouse no longer hears a member the sum of ``step``, waiting
    since ``started`` (the clock), waits on; asked once the wait has lasted the heartbeat
    timeout (None: no such question)."""
    if peers is None or time.monotonic() - started < peers.heartbeat_timeout:
        return
    lost = peers.lost()
    if lost:
        raise _Vanished(
            f"the all-reduce of step {step} waits on {', '.join(sorted(lost))}, which the Lighthouse has not "
            f"heard for over {peers.heartbeat_timeout:g} s"
        )


def _wait(work: Any, peers: PeerWatch | None, step: int) -> None:
    done = threading.Event()
    future = work.get_future()
    future.add_done_callback(lambda _: done.set())
    started = time.monotonic()
    while not done.wait(POLL_S):
        _raise_if_lost(peers, step, started)
    future.value()  # raises the collective's error
