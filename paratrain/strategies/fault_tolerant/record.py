"""The record of a fault-tolerant run: each committed step's number of participants (run
length encoded) and every heal. Every replica keeps it, and a replica that joins takes it
over with the live state, so that whichever replica reports the run reports all of it."""

from __future__ import annotations

from collections import Counter
from typing import Any


class RunRecord:
    def __init__(self) -> None:
        self.participants: Counter[int] = Counter()
        """P -> steps committed with P participants."""
        self.spans: list[list[int]] = []
        """``[first step, last step, P]``, one per run of steps with the same P."""
        self.recoveries: list[dict[str, Any]] = []
        """One per heal: the worker, its incarnation, the steps it went from and to, the seconds."""

    @property
    def steps(self) -> int:
        return sum(self.participants.values())

    def participations(self) -> int:
        """Replica-steps: each committed step counted once per participant."""
        return sum(p * c for p, c in self.participants.items())

    def count_step(self, step: int, participants: int) -> None:
        self.participants[participants] += 1
        if self.spans and self.spans[-1][2] == participants and self.spans[-1][1] == step - 1:
            self.spans[-1][1] = step
        else:
            self.spans.append([step, step, participants])

    def state_dict(self) -> dict[str, Any]:
        return {
            "participants": [[p, c] for p, c in self.participants.items()],
            "spans": [list(span) for span in self.spans],
            "recoveries": [dict(heal) for heal in self.recoveries],
        }

    def load_state_dict(self, record: dict[str, Any]) -> None:
        self.participants = Counter({int(p): int(c) for p, c in record["participants"]})
        self.spans = [[int(v) for v in span] for span in record["spans"]]
        self.recoveries = [dict(heal) for heal in record["recoveries"]]

    def summary(self) -> dict[str, Any]:
        """The metrics file's ``participants``: the fewest and most, how many steps had each
        number, and the run-length record."""
        return {
            "min": min(self.participants, default=0),
            "max": max(self.participants, default=0),
            "histogram": {str(p): c for p, c in sorted(self.participants.items())},
            "per_step": [list(span) for span in self.spans],
        }
