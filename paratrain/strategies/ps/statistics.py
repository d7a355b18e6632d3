"""The run's totals, as the chief reports them after every shard finished: each shard's
own statistics (published in the store before it answered the chief's final pull), the
other workers' bytes, and the chief's own."""

from __future__ import annotations

import resource
from collections import Counter
from typing import Any

from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.ps.protocol.wire import REPLY_HEADER_SIZE


def run_statistics(
    shards: list[dict[str, Any]], other_workers_bytes: int, chief_bytes: int, pull_ratio: float
) -> dict[str, Any]:
    """``shards``: each shard's statistics; ``pull_ratio``: wire bytes per parameter byte of
    a pull (the shards count parameter bytes; their final replies to the chief are sent in
    the pull dtype, with a header each)."""
    first = shards[0]
    final_replies = sum(int(s["bytes"] * pull_ratio) + 8 * REPLY_HEADER_SIZE for s in shards)
    return {
        "bytes_sent": other_workers_bytes + chief_bytes + final_replies + sum(s["bytes_sent"] for s in shards),
        "dropped_gradients": first["dropped_gradients"],
        "dropped_samples": first["dropped_samples"],
        "skipped_updates": first["skipped_updates"],
        "short_rounds": first["short_rounds"],
        "late_pushes": first["late_pushes"],
        "staleness": staleness_summary({int(k): v for k, v in first["staleness"].items()}),
        "workers_lost": first["workers_lost"],
        "workers_joined": first["workers_joined"],
        "bytes_per_shard": [s["bytes"] for s in shards],
        "shard_cpu_seconds": [s.get("cpu_seconds") for s in shards],
        "max_clock_gap": max(s["max_clock_gap"] for s in shards),
        # messages the shards refused, by reason (protocol/validator.py)
        "rejected_messages": dict(sum((Counter(s.get("rejected_messages", {})) for s in shards), Counter())),
        "global_steps": first["version"],
        "examples_processed": first["samples"],
        **({"tables": table_statistics(shards)} if "rows_served" in first else {}),
    }


def table_statistics(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Tables on the shards (tables/shard.py): bytes held per shard, rows served to workers'
    forward passes, rows stepped, rows left out by the stale-gradient policy, and the rows'
    staleness (the updates a row had between its pull and its gradient's arrival)."""
    staleness = sum((Counter({int(k): v for k, v in s["row_staleness"].items()}) for s in shards), Counter())
    return {
        "bytes_per_shard": [s["table_bytes"] for s in shards],
        "rows_served": sum(s["rows_served"] for s in shards),
        "rows_served_per_shard": [s["rows_served"] for s in shards],  # the layout's balance by access
        "rows_applied": sum(s["rows_applied"] for s in shards),
        "rows_dropped": sum(s["rows_dropped"] for s in shards),
        "row_staleness": staleness_summary(dict(staleness)),
    }


def max_rss_bytes() -> int:
    """This process's peak resident memory so far (what a table on the shards spares a worker)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
