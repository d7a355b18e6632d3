"""Which incarnation of its process this is: a run restarted by ``--max-restarts`` (or by
torchrun's own restarts), or a replica's replacement, starts its processes again with
``TORCHELASTIC_RESTART_COUNT`` one higher. torchrun sets that variable itself, counting only
its own restarts: a launcher that starts a replica's replacement as a new torchrun job (on
another machine: ``paratrain cluster run --spares``) says which incarnation it is in
``PARATRAIN_INCARNATION``, which adds to it."""

from __future__ import annotations

import os

INCARNATION_ENV = "PARATRAIN_INCARNATION"


def restart_count() -> int:
    """How many times this run (or this replica) was restarted or replaced, 0 at first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) + int(os.environ.get(INCARNATION_ENV, "0") or 0)
