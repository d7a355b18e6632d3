"""What a checkpoint must match to be resumed: the model and how the run is split (the
signature a run writes into its manifests: train/checkpoint.py's ``run_signature``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

#: What may differ when a mode's checkpoints reshard (``Strategy.reshards``): how many
#: replicas, and how many parameter-server shards.
RESHARDABLE = ("workers", "ps_shards", "part_names")


def check_signature(folder: Path, manifest: dict[str, Any], signature: dict[str, Any], reshards: bool = False) -> None:
    """ConfigError naming what differs where ``manifest`` was written by a run split
    otherwise than ``signature`` says (``reshards``: the replica and shard counts may)."""
    differ = [key for key in signature if manifest.get(key) != signature[key] and not (reshards and key in RESHARDABLE)]
    if differ:
        then = ", ".join(f"{k}={manifest.get(k)}" for k in differ if k != "part_names")
        now = ", ".join(f"{k}={signature[k]}" for k in differ if k != "part_names")
        if not then:  # only the parts differ: the run is split differently
            then, now = f"parts {manifest.get('part_names')}", f"parts {signature['part_names']}"
        raise ConfigError(
            f"checkpoint {folder} was written by a run with {then}; this run has {now}: "
            f"resume with the same settings, or give a new --checkpoint-dir"
        )
