"""The ``pipeline`` strategy as the registry and the run configuration see it
(strategies/spec.py)."""

from paratrain.strategies.pipeline.config import PipelineConfig
from paratrain.strategies.spec import StrategySpec

SPEC = StrategySpec(__package__, {"pipeline": "strategy:PipelineStrategy"}, "pipeline", PipelineConfig)
