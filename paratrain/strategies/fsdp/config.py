"""The options of ``fsdp``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from paratrain.options import at_least, check_options, option


@dataclass
class FSDPConfig:
    """Options of ``fsdp`` (and ``fsdp-ft``, its fault-tolerant replicas)."""

    strategies: ClassVar[tuple[str, ...]] = ("fsdp", "fsdp-ft")

    reshard_after_forward: bool = option(
        True,
        "fsdp: free each layer's gathered parameters after its forward (ZeRO-3); "
        "--no-reshard-after-forward keeps them until its backward (more memory, fewer all-gathers)",
    )

    shards_per_replica: int = option(
        1,
        "fsdp-ft: processes of each replica, its parameters sharded over them (HSDP: FSDP2 inside a replica, "
        "fault tolerance across replicas); --workers counts processes",
        strategies=("fsdp-ft",),
    )

    def __post_init__(self) -> None:
        check_options(self)
        at_least("shards_per_replica", self.shards_per_replica, 1)
