"""A warm spare: a replica's replacement started ahead of need, on a machine that stands by.

With ``PARATRAIN_STANDBY=HOST:PORT/KEY`` a fault-tolerant run's process imports what a
replica needs (torch, torchft) and then waits, at the start of its run, until the store at
``HOST:PORT`` (a torch TCPStore) holds ``KEY``. The value, a JSON object of the variables of
the replica it replaces (``REPLICA_GROUP_ID``, ``PARATRAIN_INCARNATION``, and any other its
launcher gives a replica), makes it that replica's replacement: its first quorum takes the
live state from a peer. What a cold replacement pays after its machine is
chosen (torchrun's start, Python's, torch's import) is then paid before.
``paratrain cluster run --spares`` keeps one on every idle spare host; a cluster's own
scheduler can do the same: start the run's command on a spare machine with the variable
set, and set the key when a replica is lost.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta

from paratrain.errors import ConfigError
from paratrain.session.incarnation import INCARNATION_ENV

WARM_SPARE_ENV = "PARATRAIN_STANDBY"


def replica_variables(value: str) -> dict[str, str]:
    """The variables of the replica a warm spare's assignment makes it; a ConfigError naming the form otherwise."""
    try:
        variables = json.loads(value)
    except json.JSONDecodeError:
        variables = None
    if (
        not isinstance(variables, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items())
        or not variables.get("REPLICA_GROUP_ID", "").isdigit()
    ):
        raise ConfigError(
            "a warm spare's assignment must be a JSON object of strings with REPLICA_GROUP_ID a replica index, "
            f"got {value[:200]!r}"
        )
    return variables


def take_replica_if_warm_spare(warm_up: Callable[[], None] | None = None) -> None:
    """Under ``PARATRAIN_STANDBY``, ``warm_up()`` (what the run would load first: its data,
    its model's modules), then wait for this process's replica and become its replacement;
    otherwise nothing."""
    where = os.environ.pop(WARM_SPARE_ENV, None)
    if not where:
        return
    address, _, key = where.partition("/")
    host, _, port = address.rpartition(":")
    if not key or not port.isdigit():
        raise ConfigError(f"{WARM_SPARE_ENV} must be HOST:PORT/KEY, got {where!r}")
    import torch.distributed as dist

    from paratrain.strategies.fault_tolerant.replicas import torchft_modules

    torchft_modules()  # the import a replacement pays before its first quorum, paid now
    if warm_up is not None:
        warm_up()
    # Waits as long as it is spare; the store's host going away ends the wait with an error.
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(days=7))
    store.wait([key])
    variables = replica_variables(store.get(key).decode())
    os.environ.update(variables)
    incarnation = variables.get(INCARNATION_ENV, "0")
    print(
        f"paratrain: a warm spare takes replica {variables['REPLICA_GROUP_ID']}'s place (incarnation {incarnation})",
        file=sys.stderr,
        flush=True,
    )
