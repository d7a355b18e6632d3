"""What a strategy folder tells the rest of paratrain about itself: its names, the class of
each (imported only when a run uses it) and its section of the run configuration.

Each folder's ``spec.py`` holds one ``StrategySpec`` named ``SPEC`` and imports nothing but
its own config section; ``registry.STRATEGIES`` lists the folders' specs, one line each, and
the run configuration (config.py) takes its strategy sections from them. Adding a strategy
is one folder and that one line: its options become flags and TOML keys, refused by every
strategy its section does not name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StrategySpec:
    package: str
    """The folder's package (``__package__`` in its spec.py)."""
    runtimes: dict[str, str]
    """Each name the user gives (``--strategy NAME``) -> ``"module:Class"`` of its runtime, the
    module relative to the folder (``"strategy:AllReduceStrategy"``)."""
    section: str | None = None
    """The attribute of the run configuration that holds the folder's options (``config.ps``)."""
    options: type | None = None
    """The section's dataclass of ``option()`` fields; its ``strategies`` say which names take it."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Other names for a runtime (``mirrored`` -> ``allreduce``, tf.distribute's name)."""

    def references(self) -> dict[str, str]:
        """Each name -> ``"package.module:Class"``."""
        return {name: f"{self.package}.{runtime}" for name, runtime in self.runtimes.items()}


def process_options(config: Any) -> dict[str, Any]:
    """The options of a run that every strategy's processes take (``config``: a
    TrainConfig): the device each computes on and the collective timeout."""
    return {"device": config.device, "timeout": config.timeout}
