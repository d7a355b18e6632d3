"""The options of ``allreduce``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from paratrain.errors import ConfigError
from paratrain.options import check_options, option


@dataclass
class AllReduceConfig:
    """Options of ``allreduce``."""

    strategies: ClassVar[tuple[str, ...]] = ("allreduce",)

    bucket_cap_mb: float = option(
        25.0, "allreduce: MB of gradients per all-reduce bucket (DDP's; smaller overlaps more, larger sends fewer)"
    )

    shared_memory: bool = option(
        True,
        "allreduce and the fault-tolerant strategies on the CPU: processes of one machine sum their gradients "
        "through shared memory (/dev/shm) instead of Gloo over loopback",
        strategies=("allreduce", "allreduce-ft", "pipeline-ft", "fsdp-ft", "local-sgd-ft", "diloco-ft"),
    )

    def __post_init__(self) -> None:
        check_options(self)
        if not self.bucket_cap_mb > 0:
            raise ConfigError(f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}")
