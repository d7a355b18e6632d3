"""paratrain: distributed training for PyTorch, every mode behind one switch.

import paratrain
strategy = paratrain.AllReduceStrategy()          # or SingleDeviceStrategy(), ...
with strategy.scope():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer)
trainer.fit((x, y), epochs=10, validation_data=(x_test, y_test))
"""

import importlib

# Each public name and the module it lives in (``module:attribute`` where the module names
# it otherwise), imported when first used: ``import paratrain`` alone imports no torch, so
# that a process can import one small part of paratrain before torch (the fork server's
# guard, launch/orphan.py).
_PUBLIC = {
    "AllReduceStrategy": "paratrain.strategies.allreduce.strategy",
    "Callback": "paratrain.train.callbacks",
    "Checkpoint": "paratrain.train.checkpoint",
    "ConfigError": "paratrain.errors",
    "Constant": "paratrain.train.schedules",
    "CpuTuning": "paratrain.train.cpu_tuning",
    "DiLoCoStrategy": "paratrain.strategies.averaging.strategy",
    "DivergedError": "paratrain.errors",
    "EarlyStopping": "paratrain.train.callbacks",
    "ExponentialDecay": "paratrain.train.schedules",
    "FSDPStrategy": "paratrain.strategies.fsdp.strategy",
    "FaultTolerantAllReduceStrategy": "paratrain.strategies.fault_tolerant.strategy",
    "FaultTolerantDiLoCoStrategy": "paratrain.strategies.fault_tolerant.averaging",
    "FaultTolerantFSDPStrategy": "paratrain.strategies.fault_tolerant.fsdp",
    "FaultTolerantLocalSGDStrategy": "paratrain.strategies.fault_tolerant.averaging",
    "FaultTolerantPipelineStrategy": "paratrain.strategies.fault_tolerant.pipeline",
    "History": "paratrain.train.history",
    "LearningRateScheduler": "paratrain.train.callbacks",
    "LinearScalingWarmup": "paratrain.train.schedules",
    "LocalSGDStrategy": "paratrain.strategies.averaging.strategy",
    "ParameterServerStrategy": "paratrain.strategies.ps.strategy",
    "ParatrainError": "paratrain.errors",
    "PipelineStrategy": "paratrain.strategies.pipeline.strategy",
    "SingleDeviceStrategy": "paratrain.strategies.single.strategy",
    "StopOnSignal": "paratrain.train.preemption",
    "StepOutput": "paratrain.strategies.step",
    "StepRecipe": "paratrain.strategies.recipe",
    "Strategy": "paratrain.strategies.base",
    "TensorParallelStrategy": "paratrain.strategies.tensor.strategy",
    "TrainConfig": "paratrain.config",
    "Trainer": "paratrain.train.trainer",
    "WorkerFailed": "paratrain.errors",
    "current_strategy": "paratrain.strategies.base",
    "get_strategy": "paratrain.strategies.single.strategy",
    "launch": "paratrain.launch.local",
    "load_checkpoint": "paratrain.train.checkpoint",
    "MirroredStrategy": "paratrain.strategies.allreduce.strategy:AllReduceStrategy",
    "make_strategy": "paratrain.launch.factory",
    "run_training": "paratrain.train.job:run",
    "strategy_from_flags": "paratrain.launch.factory",
}


# ``paratrain.launch`` names both a subpackage and the public function. Importing the
# subpackage sets the attribute to it, once, when it is first imported: import it now (its
# __init__ imports nothing) and drop that attribute, so that the name is the function.
importlib.import_module("paratrain.launch")
del globals()["launch"]


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
    module, _, attribute = where.partition(":")  # "module:attribute" where the names differ
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = sorted(_PUBLIC)
