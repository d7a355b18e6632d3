"""The ``ps-sync``, ``ps-backup`` and ``ps-async`` strategies as the registry and the run
configuration see them (strategies/spec.py)."""

from paratrain.strategies.ps.modes import PSConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(
    __package__, dict.fromkeys(("ps-sync", "ps-backup", "ps-async"), "strategy:ParameterServerStrategy"), "ps", PSConfig
)
