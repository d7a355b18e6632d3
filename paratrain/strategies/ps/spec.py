"""The ``ps-sync``, ``ps-backup`` and ``ps-async`` strategies as the registry and the run
configuration see them (strategies/spec.py)."""

from paratrain.strategies.ps.modes import PSConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    runtimes={
        "ps-sync": "paratrain.strategies.ps.strategy:ParameterServerStrategy",
        "ps-backup": "paratrain.strategies.ps.strategy:ParameterServerStrategy",
        "ps-async": "paratrain.strategies.ps.strategy:ParameterServerStrategy",
    },
    section="ps",
    options=PSConfig,
)
