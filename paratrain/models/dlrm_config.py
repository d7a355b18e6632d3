"""The options of ``--model dlrm`` (``models/dlrm.py``), a section that imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.options import at_least, check_options, option


@dataclass
class DLRMConfig:
    """The sizes of ``--model dlrm``; refused with any other model."""

    models = ("dlrm",)

    dlrm_dim: int = option(16, "dlrm: width of every table's rows and of the bottom MLP's output")
    dlrm_bottom: int = option(64, "dlrm: hidden width of the MLP over the dense features")
    dlrm_top: int = option(64, "dlrm: hidden width of the MLP over the features' interactions")

    def check(self) -> None:
        check_options(self)  # the types (a config file's "16")
        for name in ("dlrm_dim", "dlrm_bottom", "dlrm_top"):
            at_least(name, getattr(self, name), 1)
