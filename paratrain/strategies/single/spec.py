"""The ``single`` strategy as the registry and the run configuration see it (strategies/spec.py)."""

from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(__package__, {"single": "strategy:SingleDeviceStrategy"})
