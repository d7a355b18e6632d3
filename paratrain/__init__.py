"""paratrain: distributed training for PyTorch, every mode behind one switch.

import paratrain
strategy = paratrain.AllReduceStrategy()          # or SingleDeviceStrategy(), ...
with strategy.scope():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer)
trainer.fit((x, y), epochs=10, validation_data=(x_test, y_test))
"""

from paratrain.config import TrainConfig
from paratrain.errors import ConfigError, DivergedError, ParatrainError, WorkerFailed
from paratrain.launch.factory import make_strategy, strategy_from_flags
from paratrain.launch.local import launch
from paratrain.strategies.allreduce.strategy import AllReduceStrategy
from paratrain.strategies.averaging.strategy import DiLoCoStrategy, LocalSGDStrategy
from paratrain.strategies.base import StepOutput, Strategy, current_strategy
from paratrain.strategies.fault_tolerant.pipeline import FaultTolerantPipelineStrategy
from paratrain.strategies.fault_tolerant.strategy import FaultTolerantAllReduceStrategy
from paratrain.strategies.fsdp.strategy import FSDPStrategy
from paratrain.strategies.ps.worker import ParameterServerStrategy
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.single import SingleDeviceStrategy, get_strategy
from paratrain.train.callbacks import Callback, EarlyStopping, LearningRateScheduler
from paratrain.train.checkpoint import Checkpoint, load_checkpoint
from paratrain.train.job import run as run_training
from paratrain.train.schedules import Constant, ExponentialDecay, LinearScalingWarmup
from paratrain.train.trainer import History, Trainer

MirroredStrategy = AllReduceStrategy


def __getattr__(name: str):
    # torch.distributed.pipelining imports sympy (seconds): only when a pipeline is asked for.
    if name == "PipelineStrategy":
        from paratrain.strategies.pipeline.strategy import PipelineStrategy

        return PipelineStrategy
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "AllReduceStrategy",
    "Callback",
    "Checkpoint",
    "ConfigError",
    "Constant",
    "DiLoCoStrategy",
    "DivergedError",
    "EarlyStopping",
    "ExponentialDecay",
    "FSDPStrategy",
    "FaultTolerantAllReduceStrategy",
    "FaultTolerantPipelineStrategy",
    "History",
    "LearningRateScheduler",
    "LinearScalingWarmup",
    "LocalSGDStrategy",
    "MirroredStrategy",
    "ParameterServerStrategy",
    "ParatrainError",
    "PipelineStrategy",
    "SingleDeviceStrategy",
    "StepOutput",
    "StepRecipe",
    "Strategy",
    "TrainConfig",
    "Trainer",
    "WorkerFailed",
    "current_strategy",
    "get_strategy",
    "launch",
    "load_checkpoint",
    "make_strategy",
    "run_training",
    "strategy_from_flags",
]
