"""Tensor parallelism inside pipeline stages: a plan written for the whole model applied to
the stage a process holds, and a model traced into stages with the shapes its split layers
give.

The plan is matched once, on the whole model (tensor.py's ``planned``): a pattern that names
no module of the model is refused there, and a stage is given the modules of it that it
holds, by identity, under the names the stage holds them (an ``nn.Sequential``'s stage
counts its layers from 0 again; a traced stage prefixes them with ``model.``). A stage that
holds none of a pattern's modules simply splits nothing for it.

A traced stage is a graph (``torch.export``, through ``torch.distributed.pipelining``) that
keeps the shapes it was traced with, down to the width a view or a split of a fused
projection takes: traced whole and then split, GPT-2's attention would cut its query, key
and value at the whole width. So the model is traced as split: a copy of it whose split
layers give the shapes a process's part of them gives (``split_shaped``: a column-wise
layer's output narrowed to its slice, a row-wise layer fed its slice of the inputs) and
whose ``heads`` modules count the heads of one process. In each stage of that trace the
layers themselves are then put back in the place of those stand-ins (``put_layers``): the
user's own layer modules, which the stage splits by DTensor as ``--strategy tensor`` does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from paratrain.parallel.tensor import Style, divide_heads
from paratrain.parallel.traced import PREFIX

#: The kinds of style that split a layer's weight (the others count heads or run on positions).
SPLIT_KINDS = ("colwise", "rowwise")


def style_text(style: Style) -> str:
    """The plan's text for ``style`` (``Style.parse`` reads it back)."""
    if style.kind == "colwise" and style.gather:
        return "colwise_rep"
    if style.kind == "colwise" and style.packed > 1:
        return f"colwise:{style.packed}"
    return style.kind


def stage_plan(model: nn.Module, chosen: dict[str, Style], stage: nn.Module) -> dict[str, str]:
    """The plan of ``stage`` (a stage of ``model``): each module of ``chosen`` (by its name
    in ``model``) that the stage holds, by its name there, where its style splits a layer or
    counts heads (a traced stage holds no attention module of the model: its heads were
    counted when it was traced)."""
    modules = dict(model.named_modules())
    held = {id(module): name for name, module in stage.named_modules() if name}
    plan = {}
    for name, style in chosen.items():
        if style.kind in (*SPLIT_KINDS, "heads") and id(modules[name]) in held:
            plan[held[id(modules[name])]] = style_text(style)
    return plan


class SplitShape(nn.Module):
    """A layer as tracing sees it split ``size`` ways: a column-wise layer's output narrowed
    to one process's slice, a row-wise linear layer fed one slice of its inputs (repeated to
    the whole width for the layer it stands in for). Only the shapes count: the stage puts the
    layer itself back in its place."""

    def __init__(self, layer: nn.Module, style: Style, size: int):
        super().__init__()
        self.layer = layer
        self.style = style
        self.size = size

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        if self.style.kind == "rowwise" and not isinstance(self.layer, nn.Embedding):
            x = torch.cat([x] * self.size, dim=-1)
        out = self.layer(x, *rest)
        if self.style.kind == "colwise" and not self.style.gather:
            out = out.narrow(-1, 0, out.shape[-1] // self.size)
        return out


def split_shaped(model: nn.Module, chosen: dict[str, Style], size: int) -> nn.Module:
    """A copy of ``model`` to trace: its split layers' stand-ins (``SplitShape``), its heads
    modules counting one process's heads. The copy holds the model's values; the model is
    left as it was."""
    shaped = copy.deepcopy(model)
    for name, style in chosen.items():
        if style.kind == "heads":
            divide_heads(shaped.get_submodule(name), name, size)
        elif style.kind in SPLIT_KINDS:
            shaped.set_submodule(name, SplitShape(shaped.get_submodule(name), style, size))
    return shaped


def put_layers(stage: nn.Module, model: nn.Module, chosen: dict[str, Style]) -> None:
    """The layers of ``model`` that ``chosen`` splits, put in ``stage`` (a stage traced from
    ``split_shaped``'s copy) where their stand-ins were: the stage calls them as it called the
    stand-in, one input, one output."""
    held = {name for name, _ in stage.named_modules()}
    for name, style in chosen.items():
        if style.kind in SPLIT_KINDS and PREFIX + name in held:
            stage.set_submodule(PREFIX + name, model.get_submodule(name))
