"""``single``: one process, one device. The reference every other mode is tested against."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ConfigError
from paratrain.strategies.base import Strategy, current_strategy
from paratrain.strategies.device import resolve_device

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


class SingleDeviceStrategy(Strategy):
    name = "single"

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        if config.workers != 1:
            raise ConfigError(
                f"--strategy single trains one replica, got --workers {config.workers}; "
                "use --strategy allreduce for several"
            )

    def setup(self) -> None:
        if not self._ready:
            self.device = resolve_device(self.device_preference)
        super().setup()


def get_strategy() -> Strategy:
    """The strategy of the innermost ``with strategy.scope():``, else a single-device one."""
    return current_strategy() or SingleDeviceStrategy()
