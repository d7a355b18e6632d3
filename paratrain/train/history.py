"""A ``fit``'s per-epoch logs, and their form in a checkpoint.

A checkpoint carries the whole history, so a run of many short epochs that saves often
would pay for every epoch at every save: serialised as dicts, a history of 4,000 epochs
took 16 ms a save on a 2-core AMD EPYC, against the mlp's 55 ms between saves every 50
steps. The checkpoint holds the epochs as one JSON text instead, each epoch encoded once,
when it is first saved: a save then joins the encoded epochs, 1.9 ms at 4,000
(``benchmarks/history_save.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from paratrain.errors import ConfigError


def _plain(value: Any) -> Any:
    """A number JSON does not know (a NumPy scalar, a 0-d tensor) as a Python number."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"a history holds numbers, strings and None, not {type(value).__name__}")


@dataclass
class History:
    """Per-epoch logs of a ``fit``; ``history["test_accuracy"]`` gives one list, Keras-style.

    The same keys on every process: where a process does not evaluate (parameter-server
    workers other than the chief) its ``test_*`` values are None; a parameter-server
    shard (``role`` ``"ps"``) trains no epochs, and every list is empty."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    keys: tuple[str, ...] = ()
    """Keys every epoch logs (the loss and, with validation data, ``test_*`` of each metric)."""
    role: str = "worker"
    _encoded: list[str] = field(default_factory=list, repr=False, compare=False)
    """The JSON of ``epochs[:len(_encoded)]``, one text per epoch (epochs are only appended)."""

    @property
    def history(self) -> dict[str, list[Any]]:
        keys = {k for entry in self.epochs for k in entry} | set(self.keys)
        return {k: [entry.get(k) for entry in self.epochs] for k in sorted(keys)}

    def __getitem__(self, key: str) -> list[Any]:
        history = self.history
        if key not in history:
            raise KeyError(f"{key!r}: this history logs {', '.join(sorted(history)) or 'nothing'}")
        return history[key]

    def saved(self) -> str:
        """The epochs as one JSON array, for a checkpoint (``History.restored`` reads it)."""
        if len(self._encoded) > len(self.epochs):  # the list was shortened by hand: encode again
            self._encoded.clear()
        for entry in self.epochs[len(self._encoded) :]:
            self._encoded.append(json.dumps(entry, default=_plain, separators=(",", ":")))
        return "[" + ",".join(self._encoded) + "]"

    @classmethod
    def restored(cls, saved: str | list[dict[str, Any]]) -> History:
        """The history a checkpoint saved: the JSON of ``saved()``, or the list of dicts
        that checkpoints written before it hold."""
        epochs = json.loads(saved) if isinstance(saved, str) else saved
        if not isinstance(epochs, list) or not all(isinstance(entry, dict) for entry in epochs):
            raise ConfigError("a checkpoint's trainer history is not a list of epochs' logs")
        return cls([dict(entry) for entry in epochs])
