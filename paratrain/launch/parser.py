"""The command line's argument parser, whose errors are one line."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """A parser whose errors are one line and exit code 2, as every bad input here; a flag
    is taken only as spelled whole (``--procs-per`` for ``--procs-per-node`` would reach the
    launched processes, which take it again: torchrun started inside torchrun)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")
