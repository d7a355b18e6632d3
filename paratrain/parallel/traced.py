"""Pipelines of models that are not a sequence of layers (a Hugging Face transformer, a
user's own ``nn.Module``): ``torch.distributed.pipelining`` traces the model (torch.export)
on an example micro-batch and cuts its graph before each module named as a split point,
``transformer.h.2`` starting a stage at GPT-2's third block.

A parameter used on both sides of a cut (tied weights: the input embedding that is also the
output layer, as in most language models) is copied by the tracer into each stage that uses
it, sometimes twice into one; ``stage_of`` maps the copies back to the user's parameters by
name, for the pipeline to keep them one parameter (shared.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.shared import SplitStage, split_stage
from paratrain.parallel.split import balanced_bounds, parameter_costs
from paratrain.versions import require_torch

#: The user's model inside the traced wrapper: its names in the stages start with this.
PREFIX = "model."


class Traced(nn.Module):
    """The user's model as the tracer sees it: positional tensors in (a dict batch's, by
    ``keys``), one tensor out (a Hugging Face output's logits, a tuple's first)."""

    def __init__(self, model: nn.Module, keys: Sequence[str] = ()):
        super().__init__()
        self.model, self.keys = model, tuple(keys)
        takes = inspect.signature(model.forward).parameters
        # A language model's key-value cache is for generation: training has none to keep.
        self.options = {"use_cache": False} if "use_cache" in takes else {}

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        if self.keys:
            return first_output(self.model(**dict(zip(self.keys, tensors)), **self.options))
        return first_output(self.model(*tensors, **self.options))


def first_output(outputs: Any) -> torch.Tensor:
    """The tensor a model's outputs lead with: itself, ``logits`` of a mapping (a Hugging
    Face ``ModelOutput``) or its first tensor, the first of a tuple."""
    if torch.is_tensor(outputs):
        return outputs
    if isinstance(outputs, Mapping):
        if "logits" in outputs:
            return outputs["logits"]
        outputs = list(outputs.values())
    for value in outputs:
        if torch.is_tensor(value):
            return value
    raise ConfigError(f"a pipeline's model must return a tensor (or logits); it returned {type(outputs).__name__}")


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The model's longest ``nn.ModuleList`` (a transformer's blocks): its name and blocks."""
    lists = [(name, list(m)) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigError(
            f"{type(model).__name__} is not an nn.Sequential and has no nn.ModuleList of blocks to split between "
            "stages: name the modules where stages start, --split-points NAME,... (Python: split_points=[...])"
        )
    return max(lists, key=lambda item: len(item[1]))


def default_split_names(model: nn.Module, num_stages: int) -> list[str]:
    """Where stages start when no split point is named: the model's repeated blocks shared
    out by parameter count (what a stage holds in memory)."""
    name, blocks = repeated_blocks(model)
    if num_stages > len(blocks):
        raise ConfigError(
            f"--stages {num_stages} is more than the {len(blocks)} blocks of {type(model).__name__} ({name}); "
            "every stage needs at least one"
        )
    bounds = balanced_bounds(parameter_costs(blocks), num_stages)
    return [f"{name}.{start}" for start, _ in bounds[1:]]


def check_split_names(model: nn.Module, names: Sequence[str], num_stages: int) -> None:
    """ConfigError unless ``names`` are ``num_stages - 1`` distinct modules of ``model``."""
    if len(names) != num_stages - 1:
        raise ConfigError(
            f"--split-points {','.join(names)} makes {len(names) + 1} stages, but --stages is {num_stages}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"--split-points {','.join(names)} names a module twice")
    known = {name for name, _ in model.named_modules()}
    for name in names:
        if name not in known:
            try:
                example = f"{repeated_blocks(model)[0]}.1"
            except ConfigError:  # no blocks (an nn.Sequential named by modules): its first child
                example = next((n for n, _ in model.named_children()), "a module's name")
            raise ConfigError(
                f"--split-points: {type(model).__name__} has no module {name!r} (a stage starts at a module, "
                f"e.g. {example})"
            )


def trace(
    model: nn.Module, keys: Sequence[str], example: tuple[torch.Tensor, ...], names: Sequence[str], train: bool = True
) -> Any:
    """The model traced on ``example`` (one micro-batch) and cut before each of ``names``: a
    ``torch.distributed.pipelining`` Pipe. The graph keeps the mode it was traced in
    (``train``: dropout on; else as ``model.eval()``), whatever ``.train()`` says later."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    require_torch((2, 13), f"a pipeline of {type(model).__name__} (traced: not a sequence of layers)")
    split = {PREFIX + name: SplitPoint.BEGINNING for name in names}
    was = model.training
    # pipeline() wraps each split module's forward in place and leaves it so: put back as it
    # was after, the model runs (and traces again) as before.
    kept = {name: dict(vars(model.get_submodule(name))) for name in names}
    try:
        model.train(train)
        pipe = pipeline(Traced(model, keys), mb_args=example, split_spec=split)
    except RuntimeError as error:
        raise ConfigError(
            f"a pipeline traces {type(model).__name__} into one graph (torch.export) and could not: "
            f"{str(error).splitlines()[0]}"
        ) from None
    finally:
        model.train(was)
        for name, attributes in kept.items():
            module = vars(model.get_submodule(name))
            for attr in ("forward", "_orig_forward"):
                module.pop(attr, None)
                if attr in attributes:
                    module[attr] = attributes[attr]
    if pipe.num_stages != len(names) + 1:
        raise ConfigError(
            f"--split-points {','.join(names)} cut {type(model).__name__} into {pipe.num_stages} stages, not "
            f"{len(names) + 1}: each must be a module its forward pass calls, in the order it calls them"
        )
    return pipe


def stage_of(pipe: Any, model: nn.Module, stage: int) -> SplitStage:
    """Stage ``stage`` of ``pipe`` (traced from ``model``): its module, and its parameters
    mapped back to the user's by name."""
    users = dict(model.named_parameters(remove_duplicate=False))
    holdings = []
    for index in range(pipe.num_stages):
        held = []
        for name, param in pipe.get_stage_module(index).named_parameters(remove_duplicate=False):
            user = users.get(name.removeprefix(PREFIX))
            if user is None:
                raise RuntimeError(f"stage {index}'s parameter {name} is none of {type(model).__name__}'s")
            held.append((user, param))
        holdings.append(held)
    return split_stage(pipe.get_stage_module(stage), stage, holdings, list(users.values()))


def sharing(module: nn.Module, source: nn.Module) -> nn.Module:
    """``module`` (a stage of another trace of the same model) computing with ``source``'s
    parameters and buffers, by name: the evaluation graph of a training stage."""
    for kind, named in (("_parameters", source.named_parameters), ("_buffers", source.named_buffers)):
        theirs = dict(named(remove_duplicate=False))
        mine = module.named_parameters if kind == "_parameters" else module.named_buffers
        for name, _ in list(mine(remove_duplicate=False)):
            if name not in theirs:
                raise RuntimeError(f"the evaluation graph's {name} is not in the training stage")
            owner, _, attr = name.rpartition(".")
            getattr(module.get_submodule(owner), kind)[attr] = theirs[name]
    return module
