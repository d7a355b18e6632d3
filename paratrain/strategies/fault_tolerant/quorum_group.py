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
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

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
        def configure(self, *args: Any, **kwargs: Any) -> None:
            # torchft connects to the quorum's store and rendezvouses with its own timeout:
            # the short one for that, then the collectives' on the group it made.
            collective, self._timeout = self._timeout, rendezvous
            try:
                super().configure(*args, **kwargs)
            finally:
                self._timeout = collective
            self._pg._get_backend(torch.device("cpu")).set_timeout(collective)

    return QuorumGroupGloo(timeout=timeout)
