"""Peers that vanished: a member of this replica's quorum that the Lighthouse no longer hears.

A peer killed on a live host closes its sockets and the collective fails at once; a peer whose host vanished
closes nothing, and the collective would wait out its whole ``--timeout``. So a survivor whose collective has
waited longer than ``--replica-heartbeat-timeout`` asks the Lighthouse when it last heard each member; one not
heard for longer is gone, and the collective is abandoned (the step not committed). Members and ages come
from torchft 0.2.0's quorum answer and Lighthouse ``/status`` page (pinned in pyproject.toml; a test reads a
real page). A Lighthouse that does not answer gives no verdict: the collective waits its own timeout.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

#: What one heartbeat line of the Lighthouse's status page says: the replica id, and the
#: time since its last heartbeat in Rust's ``Duration`` form (``1.5s``, ``250ms``, ``40µs``).
HEARTBEAT_LINE = re.compile(r"^\s*(\S+): seen ([0-9.]+)(ns|µs|us|ms|s) ago\s*$", re.MULTILINE)
UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}

#: How long one question to the Lighthouse may take, in seconds.
ASK_TIMEOUT_S = 0.5


def heartbeat_ages(lighthouse: str, timeout: float = ASK_TIMEOUT_S) -> dict[str, float]:
    """Seconds since the Lighthouse at ``lighthouse`` (``http://host:port``) last heard each
    replica id it lists. OSError when it does not answer."""
    with urllib.request.urlopen(lighthouse.rstrip("/") + "/status", timeout=timeout) as answer:
        page = answer.read().decode("utf-8", "replace")
    return {rid: float(value) * UNITS[unit] for rid, value, unit in HEARTBEAT_LINE.findall(page)}


class _RecordingClient:
    """torchft's ManagerClient, with the replica ids of the last quorum it was handed."""

    def __init__(self, client: Any, peers: PeerWatch):
        self._client = client
        self._peers = peers

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self._peers.members = list(quorum.replica_ids)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class PeerWatch:
    """Which members of this replica's current quorum the Lighthouse no longer hears."""

    def __init__(self, lighthouse: str, heartbeat_timeout: float):
        self.lighthouse = lighthouse
        self.heartbeat_timeout = heartbeat_timeout
        """A member not heard for longer than this is gone (the Lighthouse's own rule)."""
        self.members: list[str] = []
        """The replica ids of the last quorum this replica's Manager was handed."""
        self.own_id = ""
        self._asked = 0.0

    def follow(self, manager: Any) -> None:
        """Record each quorum that ``manager`` (torchft's Manager) is handed from now on."""
        self.own_id = str(manager._replica_id)
        manager._client = _RecordingClient(manager._client, self)

    def lost(self) -> list[str]:
        """The members of the current quorum (this replica aside) that the Lighthouse has not
        heard for longer than the heartbeat timeout, or lists no longer; [] when it does not
        answer. Asks at most every tenth of the heartbeat timeout."""
        now = time.monotonic()
        if now - self._asked < self.heartbeat_timeout / 10:
            return []
        self._asked = now
        try:
            ages = heartbeat_ages(self.lighthouse)
        except (OSError, ValueError):
            return []
        return [
            member
            for member in self.members
            if member != self.own_id and ages.get(member, float("inf")) > self.heartbeat_timeout
        ]
