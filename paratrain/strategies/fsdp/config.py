"""The options of ``fsdp``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from paratrain.options import check_options, option


@dataclass
class FSDPConfig:
    """Options of ``fsdp``."""

    strategies: ClassVar[tuple[str, ...]] = ("fsdp",)

    reshard_after_forward: bool = option(
        True,
        "fsdp: free each layer's gathered parameters after its forward (ZeRO-3); "
        "--no-reshard-after-forward keeps them until its backward (more memory, fewer all-gathers)",
    )

    def __post_init__(self) -> None:
        check_options(self)
