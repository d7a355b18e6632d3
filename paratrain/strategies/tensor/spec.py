"""The ``tensor`` strategy as the registry and the run configuration see it (strategies/spec.py)."""

from paratrain.strategies.spec import StrategySpec
from paratrain.strategies.tensor.config import TensorConfig

SPEC = StrategySpec(__package__, {"tensor": "strategy:TensorParallelStrategy"}, "tensor", TensorConfig)
