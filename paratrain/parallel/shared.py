"""Parameters that several stages of a pipeline hold: tied weights (the input embedding that
is also the output layer, as in most language models) on both sides of a cut.

Each stage holds its own copy, in its own process. The pipeline sums the copies' gradients
over the stages holding one after each backward pass (strategies/pipeline/gradients.py), so
every copy takes the same update from the same state and they stay one parameter, as in
one process (Megatron-LM keeps its embedding and output layer in step the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

#: A stage's parameters: (the user's parameter, the stage's copy of it; the same object
#: where the stage holds the user's own layers).
Holding = list[tuple[nn.Parameter, nn.Parameter]]


@dataclass
class SplitStage:
    """One stage of a model, and where its parameters come from."""

    module: nn.Module
    index: int
    """Which stage it is."""
    copies: dict[int, list[nn.Parameter]] = field(default_factory=dict)
    """id of a parameter of the user's model -> this stage's copies of it (one, or several)."""
    tied: list[tuple[list[nn.Parameter], tuple[int, ...]]] = field(default_factory=list)
    """This stage's copies of each parameter it holds twice or that other stages hold too,
    with the stages that hold one (in the user's model's order of parameters)."""
    shared_by: list[tuple[int, ...]] = field(default_factory=list)
    """Every set of stages that shares a parameter, the same list on every stage."""


def split_stage(
    module: nn.Module, index: int, holdings: Sequence[Holding], order: Sequence[nn.Parameter]
) -> SplitStage:
    """Stage ``index`` (``module``) of a split whose stages hold ``holdings``; ``order``: the
    user's parameters in their model's order (every stage lists shared ones alike)."""
    holders: dict[int, set[int]] = {}
    mine = SplitStage(module, index)
    for stage, held in enumerate(holdings):
        for user, param in held:
            holders.setdefault(id(user), set()).add(stage)
            if stage == index and not any(param is p for p in mine.copies.get(id(user), [])):
                mine.copies.setdefault(id(user), []).append(param)
    for user in dict.fromkeys(order):  # each parameter once
        stages = tuple(sorted(holders.get(id(user), ())))
        if len(stages) > 1 and stages not in mine.shared_by:
            mine.shared_by.append(stages)
        copies = mine.copies.get(id(user), [])
        if len(copies) > 1 or (copies and len(stages) > 1):
            mine.tied.append((copies, stages))
    return mine
