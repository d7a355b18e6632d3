"""A parameter-server checkpoint read by another number of shards (``--ps-shards``).

Shard ``s`` of ``P`` holds elements ``[total*s//P, total*(s+1)//P)`` of the flat vector of
all parameters (layout.py), and an optimizer over its pieces. Every optimizer state that
has one value per element (momentum, Adam's moments) is laid out the same way, so the
saved shards' slices are put end to end and cut again at the new bounds; a value per
parameter (Adam's step count) goes to every piece of that parameter. The update rules
are elementwise, so a resharded run takes the same steps as the run that saved it.

The data position and the counters come from the saved shard with the same index (the
last one for a shard the saving run did not have): every shard sees every gradient, and
only shard 0 hands out batches.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.errors import ConfigError
from paratrain.strategies.ps.layout import Piece, ShardLayout


def optimizer_order(layout: ShardLayout, shard: int, group_of: list[int]) -> list[Piece]:
    """A shard optimizer's parameters in the order of its ``state_dict``: by the user's
    parameter group, then as the layout lists them."""
    return sorted(layout.pieces[shard], key=lambda piece: group_of[piece.index])


def reshard(states: list[dict[str, Any]], layout: ShardLayout, shard: int, group_of: list[int]) -> dict[str, Any]:
    """Shard ``shard``'s state under ``layout`` from the states of every saved shard, in
    shard order (``ShardServer.state_dict``); ``group_of[i]`` is parameter ``i``'s group."""
    versions = sorted({int(state["version"]) for state in states})
    if len(versions) != 1:
        raise ConfigError(f"the checkpoint's {len(states)} shard parts hold different versions {versions}")
    flat = torch.cat([state["params"].reshape(-1) for state in states])
    if flat.numel() != layout.total:
        raise ConfigError(f"the checkpoint's shards hold {flat.numel()} parameters, this model has {layout.total}")
    saved = ShardLayout(layout.shapes, len(states), layout.element_size)
    starts = [sum(layout.numels[:i]) for i in range(len(layout.numels))]
    per_element: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key: (values, which are set)
    per_param: dict[int, dict[str, Any]] = {}
    hyper: dict[int, dict[str, Any]] = {}
    for old, state in enumerate(states):
        pieces = optimizer_order(saved, old, group_of)
        saved_groups = state["optimizer"]["param_groups"]
        for group, entry in zip(sorted({group_of[p.index] for p in pieces}), saved_groups, strict=True):
            hyper.setdefault(group, {k: v for k, v in entry.items() if k != "params"})
        ids = [pid for entry in saved_groups for pid in entry["params"]]
        for pid, piece in zip(ids, pieces, strict=True):
            lo = starts[piece.index] + piece.start
            for key, value in state["optimizer"]["state"].get(pid, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.numel:
                    values, known = per_element.setdefault(
                        key,
                        (
                            torch.zeros(layout.total, dtype=value.dtype, device="cpu"),
                            torch.zeros(layout.total, dtype=torch.bool, device="cpu"),
                        ),
                    )
                    values[lo : lo + piece.numel] = value.reshape(-1)
                    known[lo : lo + piece.numel] = True
                else:
                    per_param.setdefault(piece.index, {})[key] = value
    pieces = optimizer_order(layout, shard, group_of)
    optimizer_state: dict[int, dict[str, Any]] = {}
    for pid, piece in enumerate(pieces):
        lo, hi = starts[piece.index] + piece.start, starts[piece.index] + piece.stop
        entry = {key: values[lo:hi].clone() for key, (values, known) in per_element.items() if bool(known[lo:hi].all())}
        for key, value in per_param.get(piece.index, {}).items():
            entry[key] = value.clone() if torch.is_tensor(value) else value
        if entry:
            optimizer_state[pid] = entry
    groups, next_id = [], 0
    for group in sorted({group_of[p.index] for p in pieces}):
        count = sum(1 for p in pieces if group_of[p.index] == group)
        groups.append({**hyper[group], "params": list(range(next_id, next_id + count))})
        next_id += count
    same = states[min(shard, len(states) - 1)]
    return {
        **{k: v for k, v in same.items() if k not in ("params", "optimizer")},
        "params": flat[layout.shard_range(shard)].clone(),
        "optimizer": {"state": optimizer_state, "param_groups": groups},
    }
