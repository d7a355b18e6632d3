"""What a parameter-server shard counts as it serves: the staleness of the gradients it
applied, those it dropped or skipped, its rounds and its traffic. Checkpointed with the
shard (under the keys earlier versions wrote) and published as its statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: The counters a checkpoint holds; the rest (traffic, clock gap) describe one process's run.
CHECKPOINTED = ("dropped", "dropped_samples", "samples", "skipped", "short_rounds", "late_pushes")


@dataclass
class ShardCounters:
    staleness: Counter[int] = field(default_factory=Counter)
    """Applied gradients by staleness (versions published since the worker pulled)."""
    dropped: int = 0
    dropped_samples: int = 0
    samples: int = 0
    skipped: int = 0
    """Updates skipped for a NaN or Inf gradient (--on-nan skip)."""
    short_rounds: int = 0
    """Synchronous versions made of fewer gradients than a round."""
    late_pushes: int = 0
    """Pushes that came as a header alone, their round closed (LATE)."""
    bytes_sent: int = 0
    max_clock_gap: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"staleness": dict(self.staleness), **{name: getattr(self, name) for name in CHECKPOINTED}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        for name in CHECKPOINTED:  # the last three came later: older checkpoints lack them
            setattr(self, name, int(state.get(name, 0)))

    def statistics(self) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "samples": self.samples,
            "dropped_gradients": self.dropped,
            "dropped_samples": self.dropped_samples,
            "skipped_updates": self.skipped,
            "short_rounds": self.short_rounds,
            "late_pushes": self.late_pushes,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "max_clock_gap": self.max_clock_gap,
        }
