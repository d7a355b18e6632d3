"""The ``local-sgd`` and ``diloco`` strategies as the registry and the run configuration see
them (strategies/spec.py)."""

from paratrain.strategies.averaging.config import AveragingConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    runtimes={
        "local-sgd": "paratrain.strategies.averaging.strategy:LocalSGDStrategy",
        "diloco": "paratrain.strategies.averaging.strategy:DiLoCoStrategy",
    },
    section="averaging",
    options=AveragingConfig,
)
