"""The ``allreduce`` strategy as the registry and the run configuration see it
(strategies/spec.py)."""

from paratrain.strategies.allreduce.config import AllReduceConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    __package__, {"allreduce": "strategy:AllReduceStrategy"}, "allreduce", AllReduceConfig, {"mirrored": "allreduce"}
)
