"""Checkpoints of a fault-tolerant run (``allreduce-ft --checkpoint-dir``), for the one loss
live peers cannot cover: every replica at once (a power cut, a job killed whole).

Every replica holds the same committed state, so a checkpoint is one part (``rank-0``: the
model, the optimizer, the loop's position and the run's record) written by one replica, the
first of the step's quorum, while the others go on to their next step (they wait for it
only in that step's quorum, the time of one ``torch.save``). Any replica that starts with a
checkpoint to resume from (``--resume``, or a replacement: ``--max-restarts``) loads it, and
its Manager takes the checkpoint's step as its own; a replacement that finds live peers is
then healed from them as before (their step is later), and one that finds none goes on from
the checkpoint instead of failing. So when every replica is lost, the replacements resume
from the last checkpoint: the steps since it are done again, as in any restart.
"""

from __future__ import annotations

import os
from typing import Any

from paratrain.checkpoints.files import RunCheckpoints
from paratrain.checkpoints.replica import ReplicaState


def life_token() -> str:
    """What every process of one replica shares in one life of it, and no other life does,
    without a collective (the replica's processes need not agree on a save step to make it):
    the launch (the local launcher's run folder, else torchrun's run id and rendezvous), the
    replica's slot and its incarnation (a replacement's processes are all new)."""
    env = os.environ
    launch = env.get("PARATRAIN_PROGRESS") or (
        f"{env.get('TORCHELASTIC_RUN_ID', '')}@{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    )
    return f"{launch}|{env.get('REPLICA_GROUP_ID', '')}|{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class QuorumState:
    """The state writer of a fault-tolerant replica (checkpoints/files.py's StateWriter)."""

    checks_fresh_folder = False  # a replica that starts late may find its peers' checkpoints

    def __init__(self, files: RunCheckpoints, loop: Any, session: Any):
        self.replica = ReplicaState(files, loop)
        """Writes and reads the one part, as a replica of allreduce writes and reads its own."""
        # A step's save may find the parts of the same step's save cut short in a former life
        # of the run (every replica lost, the folder left for a peer that may be writing it)
        self.replica.token = life_token()
        self.session = session

    def restore(self) -> None:
        # A replica that resumes late may find a peer, resumed sooner, saving a later step:
        # that unfinished save is the peer's, not one a crash cut short.
        self.replica.restore(peers_write=True)

    def at_step(self, step: int) -> None:
        if self.session.first_in_quorum(self.replica.strategy.process_rank == 0):
            self.replica.at_step(step)

    def at_version(self, version: int) -> None:
        """A replica publishes no versions."""

    def at_end(self, step: int) -> None:
        self.at_step(step)
