"""The ``allreduce-ft`` and ``pipeline-ft`` strategies as the registry and the run
configuration see them (strategies/spec.py)."""

from paratrain.strategies.fault_tolerant.config import FTConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    runtimes={
        "allreduce-ft": "paratrain.strategies.fault_tolerant.strategy:FaultTolerantAllReduceStrategy",
        "pipeline-ft": "paratrain.strategies.fault_tolerant.pipeline:FaultTolerantPipelineStrategy",
    },
    section="ft",
    options=FTConfig,
)
