"""Tensor parallelism inside pipeline stages: a plan written for the whole model applied to the stage a
process holds, and a model traced into stages with the shapes its split layers give.

The plan is matched once, on the whole model (tensor.py's ``planned``, which refuses a pattern that names
no module); each stage gets the modules it holds, by identity, under its own names for them. A traced stage
(``torch.export``) keeps the shapes it was traced with, so a model traced whole would cut GPT-2's fused
query/key/value at the whole width. The model is therefore traced as split: a copy whose split layers give a
process's shapes (``split_shaped``) and whose ``heads`` modules count one process's heads; in each traced stage
the user's own layers then replace those stand-ins (``put_layers``), to be split by DTensor as
``--strategy tensor`` does.
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
