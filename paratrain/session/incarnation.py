"""Which incarnation of its process this is: a run restarted by ``--max-restarts`` (or by
torchrun's own restarts), or a replica's replacement, starts its processes again with
``TORCHELASTIC_RESTART_COUNT`` one higher."""

from __future__ import annotations

import os


def restart_count() -> int:
    """How many times this run was restarted (--max-restarts, or torchrun's), 0 at first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
