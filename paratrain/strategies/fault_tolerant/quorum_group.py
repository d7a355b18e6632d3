"""The gradient group of a quorum: torchft's reconfigurable Gloo group, whose rendezvous
has a deadline of its own, shorter than its collectives'.

torchft forms a new Gloo group for each new quorum, in the quorum's store (hosted by its
first member), and gives the connection to that store, the group's rendezvous and its
collectives one and the same timeout (``--timeout``). A member lost between the quorum
and the rendezvous (killed while its replacement took the live state, say) then held every
other member for the whole ``--timeout``: its store refused connections, or its address
never came, and the survivors waited it out before they could form a quorum without it
(found by benchmarks/ft_stress.py: 20 s stalls with ``--timeout 20``). Every member
configures the group as soon as the Lighthouse hands out the quorum, so a rendezvous that
takes longer than the Lighthouse takes to drop a silent member (``--replica-heartbeat-timeout``)
plus a few seconds of a loaded machine has lost a member: it fails there, the step is not
committed, and the next quorum forms without the lost one. The collectives keep the whole
``--timeout``.

A collective on a peer that vanished without closing its connections would also wait the
whole ``--timeout``: ``sum_in_quorum`` waits for it while asking the Lighthouse whether a
member is gone (peers.py), and abandons it when one is. The group of an abandoned
collective is kept until that collective ends on its own: dropping it would join the Gloo
thread that waits in it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from paratrain.errors import WorkerLost
from paratrain.strategies.fault_tolerant.peers import PeerWatch
from paratrain.strategies.fault_tolerant.replicas import torchft_modules

#: What a rendezvous may take beyond the Lighthouse's heartbeat timeout: the slowest member
#: of a loaded machine getting to its configure.
RENDEZVOUS_SLACK_S = 2.0


def rendezvous_timeout(timeout: float, heartbeat_timeout: float) -> timedelta:
    """The deadline of a quorum group's rendezvous: never longer than ``timeout``."""
    return timedelta(seconds=min(timeout, heartbeat_timeout + RENDEZVOUS_SLACK_S))


def quorum_group(timeout: timedelta, rendezvous: timedelta) -> Any:
    """A torchft Gloo group (a Manager's ``pg``) whose rendezvous waits at most ``rendezvous``
    and whose collectives wait ``timeout``."""
    base = torchft_modules().ProcessGroupGloo

    class QuorumGroupGloo(base):
        def __init__(self, timeout: timedelta):
            super().__init__(timeout=timeout)
            self.abandoned: list[Any] = []
            """Works of this quorum's group that were given up (their tensors with them)."""
            self.retired: list[tuple[Any, list[Any]]] = []
            """Groups of earlier quorums whose abandoned works have not ended yet."""

        def configure(self, *args: Any, **kwargs: Any) -> None:
            self.retired = [(pg, works) for pg, works in self.retired if not all(w.is_completed() for w in works)]
            if self.abandoned:
                self.retired.append((self._pg, self.abandoned))
                self.abandoned = []
            # torchft connects to the quorum's store and rendezvouses with its own timeout:
            # the short one for that, then the collectives' on the group it made.
            collective, self._timeout = self._timeout, rendezvous
            try:
                super().configure(*args, **kwargs)
            finally:
                self._timeout = collective
            self._pg._get_backend(torch.device("cpu")).set_timeout(collective)

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


class _Vanished(WorkerLost):
    pass


def _wait(work: Any, peers: PeerWatch | None, step: int) -> None:
    done = threading.Event()
    future = work.get_future()
    future.add_done_callback(lambda _: done.set())
    started = time.monotonic()
    while not done.wait(POLL_S):
        if peers is None or time.monotonic() - started < peers.heartbeat_timeout:
            continue
        lost = peers.lost()
        if lost:
            raise _Vanished(
                f"the all-reduce of step {step} waits on {', '.join(sorted(lost))}, which the Lighthouse has not "
                f"heard for over {peers.heartbeat_timeout:g} s"
            )
    future.value()  # raises the collective's error
