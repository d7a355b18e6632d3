"""The options of a fault-tolerant strategy's session, from the run's configuration, and
their checks (before any process starts)."""

from __future__ import annotations

from typing import Any

import torch

from paratrain.errors import ConfigError

#: Codecs whose payloads add up: the Manager's one all-reduce sums them (in 16 bits).
WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def session_options(config: Any) -> dict[str, Any]:
    """A run's options of the replica and its session (``config``: a TrainConfig), as the
    keyword arguments of a fault-tolerant strategy."""
    ft = config.ft
    return {
        "device": config.device,
        "timeout": config.timeout,
        "workers": config.workers,
        "lighthouse": ft.lighthouse,
        "min_replicas": ft.min_replicas,
        "heartbeat_timeout": ft.replica_heartbeat_timeout,
        "compression": config.codec.compression,
        "shared_memory": config.allreduce.shared_memory,
    }


def check_compression(strategy: str, compression: str) -> None:
    if compression not in WIRE_DTYPES:
        raise ConfigError(
            f"--strategy {strategy} sums each step's gradient in one all-reduce: --compression must be "
            f"one of {', '.join(WIRE_DTYPES)} (payloads that add up), got {compression!r}"
        )


def check_quorum_options(strategy: str, config: Any, replicas: int, counted: str) -> None:
    """``--compression`` and ``--min-replicas`` of a fault-tolerant run (``config``: a
    TrainConfig) of ``replicas`` replicas of several processes (``counted``: the flags they
    are counted from)."""
    check_compression(strategy, config.codec.compression)
    if config.ft.min_replicas > replicas:
        raise ConfigError(
            f"--min-replicas {config.ft.min_replicas} is more than the run's {replicas} {counted}: no step could commit"
        )
