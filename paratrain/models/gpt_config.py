"""The options of ``--model gpt`` (``models/gpt.py``): a configuration section that imports
no torch, so that the run's configuration sits below the models."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.options import at_least, check_options, option


@dataclass
class GPTConfig:
    """The sizes of ``--model gpt``; refused with any other model."""

    models = ("gpt",)

    gpt_layers: int = option(4, "gpt: transformer blocks")
    gpt_width: int = option(128, "gpt: width of the embeddings and of every block")
    gpt_heads: int = option(4, "gpt: attention heads (they split --gpt-width evenly)")
    gpt_dropout: float = option(0.0, "gpt: dropout after the embeddings, attention and each MLP")

    def check(self) -> None:
        check_options(self)  # the types (a config file's 2.0 layers, "0.1" dropout)
        for name in ("gpt_layers", "gpt_width", "gpt_heads"):
            at_least(name, getattr(self, name), 1)
        if self.gpt_width % self.gpt_heads:
            raise ConfigError(f"--gpt-heads {self.gpt_heads} must divide --gpt-width {self.gpt_width}")
        if not 0.0 <= self.gpt_dropout < 1.0:
            raise ConfigError(f"--gpt-dropout must be in [0, 1), got {self.gpt_dropout}")
