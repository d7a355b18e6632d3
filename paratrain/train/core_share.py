"""A run's compute threads following its share of the machine's cores (launch/host_share.py)
as other runs start and end: taken between two steps, on the compute thread."""

from __future__ import annotations

from typing import Any

from paratrain.console import console
from paratrain.launch.host_share import HostShare
from paratrain.train.callbacks import Callback


class FollowCoreShare(Callback):
    """Before every step, the threads this process's share says now; the chief says so in
    one line whenever they change."""

    def __init__(self, share: HostShare):
        self.share = share

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        before = self.share.threads
        if self.share.apply() and self.trainer.strategy.is_chief:
            now = self.share.threads
            console.print(
                f"paratrain: step {step + 1}: {self.share.sharing} paratrain processes on this machine's "
                f"{self.share.usable} cores: {now} compute thread{'s' if now > 1 else ''} a process now (was {before})"
            )
