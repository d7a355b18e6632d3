"""The ``allreduce-ft`` and ``pipeline-ft`` strategies as the registry and the run
configuration see them (strategies/spec.py)."""

from paratrain.strategies.fault_tolerant.config import FTConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    __package__,
    {
        "allreduce-ft": "strategy:FaultTolerantAllReduceStrategy",
        "pipeline-ft": "pipeline:FaultTolerantPipelineStrategy",
    },
    "ft",
    FTConfig,
)
