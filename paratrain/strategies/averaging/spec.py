"""The ``local-sgd`` and ``diloco`` strategies as the registry and the run configuration see
them (strategies/spec.py)."""

from paratrain.strategies.averaging.config import AveragingConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    __package__,
    {"local-sgd": "strategy:LocalSGDStrategy", "diloco": "strategy:DiLoCoStrategy"},
    "averaging",
    AveragingConfig,
)
