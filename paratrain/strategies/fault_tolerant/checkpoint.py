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

from typing import Any

from paratrain.checkpoints.files import RunCheckpoints
from paratrain.checkpoints.replica import ReplicaState


class QuorumState:
    """The state writer of a fault-tolerant replica (checkpoints/files.py's StateWriter)."""

    checks_fresh_folder = False  # a replica that starts late may find its peers' checkpoints

    def __init__(self, files: RunCheckpoints, loop: Any, session: Any):
        self.replica = ReplicaState(files, loop)
        """Writes and reads the one part, as a replica of allreduce writes and reads its own."""
        # A step's save may find the parts of the same step's save cut short in a former life
        # of the run (every replica lost, the folder left for a peer that may be writing it)
        self.replica.tokened = True
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
