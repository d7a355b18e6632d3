"""The fault-tolerant strategies (``allreduce-ft``, ``pipeline-ft``, ``local-sgd-ft``, ``diloco-ft``, ``fsdp-ft``) as the registry and the run
configuration see them (strategies/spec.py)."""

from paratrain.strategies.fault_tolerant.config import FTConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    __package__,
    {
        "allreduce-ft": "strategy:FaultTolerantAllReduceStrategy",
        "pipeline-ft": "pipeline:FaultTolerantPipelineStrategy",
        "local-sgd-ft": "averaging:FaultTolerantLocalSGDStrategy",
        "diloco-ft": "averaging:FaultTolerantDiLoCoStrategy",
        "fsdp-ft": "fsdp:FaultTolerantFSDPStrategy",
    },
    "ft",
    FTConfig,
)
