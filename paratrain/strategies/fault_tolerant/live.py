"""The live state a replica that joins a fault-tolerant run takes from a peer, over
torchft's state transfer: the model, the optimizer, the loop's position and the session's
record. No checkpoint is read. ``session`` is the replica's ``FaultTolerantSession``
(session.py)."""

from __future__ import annotations

from typing import Any


def live_state(session: Any) -> dict[str, Any]:
    """Served to a joiner during a quorum, while this replica's loop waits in it: the step
    being started is the joiner's first, so the loop's position is one batch back."""
    trainer = session.trainer
    assert trainer is not None, "a replica serves state only once it trains"
    position = trainer.state_dict()
    position["batch"] = max(trainer.batch - 1, 0)
    return {
        "model": trainer.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "trainer": position,
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
    session.joined_state = state["trainer"]
