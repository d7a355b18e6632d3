"""Drills that kill processes of real runs at random moments, and check how each run ends.

The moments and victims come from a seed: a drill prints it, and ``PARATRAIN_DRILL_SEED=S``
repeats it (``drill_seed``). ``random_kill``: one kill in a run of any strategy;
``replica_kills``: many kills in a run of a fault-tolerant strategy.
"""

from __future__ import annotations

import os
import random

#: The environment variable that repeats a drill: its seed, as the drill printed it.
SEED_VARIABLE = "PARATRAIN_DRILL_SEED"


def drill_seed() -> int:
    """``PARATRAIN_DRILL_SEED`` when set (to repeat a drill), else a fresh seed."""
    given = os.environ.get(SEED_VARIABLE)
    if given:
        try:
            return int(given)
        except ValueError:
            raise SystemExit(f"{SEED_VARIABLE}={given!r}: expected the integer seed a drill printed") from None
    return random.SystemRandom().randrange(10**6)
