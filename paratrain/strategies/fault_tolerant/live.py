"""The live state a replica that joins a fault-tolerant run takes from a peer, over
torchft's state transfer: the model, the optimizer, the loop's position and the session's
record. No checkpoint is read. ``session`` is the replica's ``FaultTolerantSession``
(session.py)."""

from __future__ import annotations

from typing import Any


def position_before_step(trainer: Any) -> dict[str, Any]:
    """The loop's position while it waits in the quorum of the step it started: that step is
    the joiner's first, so the position is one batch back."""
    position = trainer.state_dict()
    position["batch"] = max(trainer.batch - 1, 0)
    return position


def live_state(session: Any) -> dict[str, Any]:
    """Served to a joiner during a quorum, while this replica's loop waits in it, at the
    position the session's schedule says."""
    trainer = session.trainer
    assert trainer is not None, "a replica serves state only once it trains"
    return {
        "model": trainer.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "trainer": session.schedule.live_position(trainer),
        "strategy": session.replica.state_dict(),  # its session's record and last loss with it
    }


def load_live_state(session: Any, state: dict[str, Any]) -> None:
    """A peer's state into this replica; the loop's position waits in ``session.joined_state``
    until the loop can take it (``FaultTolerantSession.begin``, or the step that healed)."""
    trainer = session.trainer
    assert trainer is not None
    trainer.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    own = state["strategy"]
    session.replica.skipped_updates = int(own["skipped_updates"])
    session.load_state_dict(own)
    session.schedule.take_live_state(own)
    session.joined_state = state["trainer"]
