"""The ``fsdp`` strategy as the registry and the run configuration see it (strategies/spec.py)."""

from paratrain.strategies.fsdp.config import FSDPConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(__package__, {"fsdp": "strategy:FSDPStrategy"}, "fsdp", FSDPConfig)
