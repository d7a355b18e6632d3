"""``--tensor-parallel``, ``--tp-plan``, ``--shard-replicas`` and ``--loss-parallel``: the section
of TrainConfig (config.py) that the ``tensor`` strategy takes (``pipeline`` takes the first two,
to split its stages); like every section it imports no strategy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from paratrain.errors import ConfigError
from paratrain.options import at_least, check_options, option

#: ``--tensor-parallel`` where it is not given, by strategy: ``tensor`` exists to split, a
#: pipeline splits its stages only when asked (3-D).
DEFAULT_DEGREES = {"tensor": 2, "pipeline": 1}


@dataclass
class TensorConfig:
    """Options of ``--strategy tensor``."""

    strategies: ClassVar[tuple[str, ...]] = ("tensor",)

    tensor_parallel: int | None = option(
        None,
        "tensor: processes each layer is split over (T, default 2); --workers W processes make W/T replicas. "
        "pipeline: processes each stage's layers are split over (default 1, none); W processes make "
        "W/(stages x T) pipeline replicas (3-D: data x pipeline x tensor)",
        strategies=("tensor", "pipeline"),
    )
    shard_replicas: bool = option(
        False,
        "tensor: shard each process's part of the parameters, gradients and optimizer state over the replicas "
        "too (FSDP2 over the replica dimension of the mesh: 2-D, as torchtitan's FSDP x TP)",
    )
    loss_parallel: bool = option(
        True,
        "tensor: keep the output layer's logits split by vocabulary and compute a cross-entropy loss on the "
        "slices (torch's loss_parallel), with no all-gather of the whole logits; other losses and the metrics get "
        "them whole",
    )
    sequence_parallel: bool = option(
        False,
        "tensor: hold the activations between the split layers (norms, dropouts, the residual stream) split by "
        "position too: each process 1/T of them; reduce-scatters and all-gathers in place of the all-reduces "
        "(the plan's sequence and split_sequence modules: the gpt's)",
    )
    tp_plan: str | None = option(
        None,
        "tensor: how to split the model, as JSON or a JSON file: module pattern to style (colwise, colwise:K, "
        'colwise_rep, rowwise, heads), e.g. \'{"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}\'; '
        "default: the model's own plan; pipeline: the same plan, each stage splitting the modules it holds",
        strategies=("tensor", "pipeline"),
    )

    def __post_init__(self) -> None:
        check_options(self)
        at_least("tensor_parallel", self.tensor_parallel, 1)
        self.plan()  # a plan that does not read is refused with the options

    def degree(self, strategy: str) -> int:
        """T for ``strategy``: ``--tensor-parallel`` where given, else the strategy's default
        (``DEFAULT_DEGREES``: tensor splits in 2, a pipeline's stages stay whole)."""
        return self.tensor_parallel if self.tensor_parallel is not None else DEFAULT_DEGREES.get(strategy, 1)

    def plan(self) -> dict[str, str] | None:
        """``--tp-plan`` read: a dict of module pattern to style, or None (the model's own)."""
        if self.tp_plan is None:
            return None
        text = self.tp_plan
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).expanduser().read_text()
            except OSError as error:
                raise ConfigError(
                    f"--tp-plan {self.tp_plan}: not JSON, and not a file that reads ({error.strerror})"
                ) from None
        try:
            plan = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--tp-plan: not JSON ({error.msg} at line {error.lineno})") from None
        if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
            raise ConfigError('--tp-plan must be a JSON object of module pattern to style, e.g. {"fc1": "colwise"}')
        return plan
