"""The options of ``--model lstm`` (``models/lstm_classifier.py``), a section that imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.options import at_least, check_options, option


@dataclass
class LSTMConfig:
    """The sizes of ``--model lstm``; refused with any other model."""

    models = ("lstm",)

    lstm_layers: int = option(
        1, "lstm: stacked LSTM layers (--strategy pipeline --schedule wavefront puts one on each stage)"
    )

    def check(self) -> None:
        check_options(self)  # the type (a config file's 2.5 layers)
        at_least("lstm_layers", self.lstm_layers, 1)
