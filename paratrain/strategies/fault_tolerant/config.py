"""The options of ``allreduce-ft`` and ``pipeline-ft``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from paratrain.errors import ConfigError
from paratrain.options import check_options, option


@dataclass
class FTConfig:
    """Options of the fault-tolerant strategies (``--fault-tolerant``)."""

    strategies: ClassVar[tuple[str, ...]] = ("allreduce-ft", "pipeline-ft", "local-sgd-ft", "diloco-ft", "fsdp-ft")

    lighthouse: str | None = option(
        None,
        "allreduce-ft: the Lighthouse's address (http://HOST:PORT, from torchft_lighthouse) for runs across "
        "machines; a local run starts its own",
    )
    min_replicas: int = option(1, "allreduce-ft: fewest replicas a step may commit with; below it the run waits")
    replica_heartbeat_timeout: float = option(
        0.2, "allreduce-ft: seconds without a heartbeat before the Lighthouse drops a replica (a local run's own)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.min_replicas < 1:
            raise ConfigError(f"--min-replicas must be >= 1, got {self.min_replicas}")
        if not self.replica_heartbeat_timeout > 0:
            raise ConfigError(f"--replica-heartbeat-timeout must be > 0, got {self.replica_heartbeat_timeout}")
        if self.lighthouse is not None and not self.lighthouse.startswith(("http://", "https://")):
            raise ConfigError(f"--lighthouse must be an address like http://HOST:29510, got {self.lighthouse!r}")
