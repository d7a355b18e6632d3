"""``--dataset clicks``: a synthetic click log, made on the spot (no download).

Each example has dense features and one id per categorical feature (table), drawn from a
Zipf law over the table's rows (row 0 most often), and a label from a rule the model can
learn: every id carries a hidden score, and the example is a click when the scores of its
ids plus a linear function of its dense features exceed a threshold (set so that about
a third are clicks). Frequent ids are learnt first; rare ones are seen a few times at most,
as in real logs.

Sizes by argument: ``clicks:tables=4,rows=10000,examples=16384,dense=8,zipf=1.1,seed=0``
(the defaults; ``rows`` may be one number or one per table separated by ``/``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from paratrain.data.spec import DataSpec, Splits
from paratrain.errors import ConfigError

DEFAULTS = {"tables": "4", "rows": "10000", "examples": "16384", "dense": "8", "zipf": "1.1", "seed": "0"}
TEST_SHARE = 0.2


class Clicks(Dataset):
    def __init__(self, dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor):
        self.dense = dense
        self.ids = ids
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {"dense": self.dense[index], "ids": self.ids[index]}, self.labels[index]


def parse(argument: str | None) -> dict[str, Any]:
    options = dict(DEFAULTS)
    for item in filter(None, (argument or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise ConfigError(
                f"--dataset clicks:{argument}: {item!r} is not KEY=VALUE with KEY one of {', '.join(DEFAULTS)}"
            )
        options[key] = value
    try:
        tables = int(options["tables"])
        rows = [int(r) for r in options["rows"].split("/")]
        rows = rows * tables if len(rows) == 1 else rows
        sizes = {"examples": int(options["examples"]), "dense": int(options["dense"]), "seed": int(options["seed"])}
        zipf = float(options["zipf"])
    except ValueError:
        raise ConfigError(f"--dataset clicks:{argument}: sizes are integers, zipf a number") from None
    if tables < 1 or len(rows) != tables or min(rows) < 2 or sizes["examples"] < 10 or sizes["dense"] < 1 or zipf <= 0:
        raise ConfigError(
            f"--dataset clicks:{argument}: needs tables >= 1 with rows >= 2 each (one number, or one per table), "
            "examples >= 10, dense >= 1, zipf > 0"
        )
    return {"rows": rows, "zipf": zipf, **sizes}


def _zipf_ids(rng: np.random.Generator, rows: int, count: int, exponent: float) -> np.ndarray:
    """Ids in ``[0, rows)`` with P(id) falling as (id + 1) ** -exponent: the continuous power
    law's inverse distribution, floored (memory by examples, not by rows)."""
    u = rng.random(count)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * np.log(rows + 1.0))
    else:
        a = 1.0 - exponent
        x = (u * ((rows + 1.0) ** a - 1.0) + 1.0) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)


def _scores(ids: np.ndarray, salt: int) -> np.ndarray:
    """Each id's hidden score in [-1.5, 1.5), a hash of the id (no table of scores is made)."""
    h = (ids.astype(np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(29)
    return (h >> np.uint64(11)).astype(np.float64) / 2.0**53 * 3.0 - 1.5


def make_clicks(rows: list[int], examples: int, dense: int, zipf: float, seed: int) -> tuple[Clicks, Clicks]:
    rng = np.random.default_rng(seed)
    ids = np.stack([_zipf_ids(rng, n, examples, zipf) for n in rows], axis=1)
    features = rng.standard_normal((examples, dense)).astype(np.float32)
    logit = features @ rng.standard_normal(dense) * 0.5
    salts = rng.integers(1 << 40, size=len(rows))
    for t in range(len(rows)):
        logit += _scores(ids[:, t], int(salts[t]))
    labels = (logit > np.quantile(logit, 2 / 3)).astype(np.int64)
    cut = int(examples * (1 - TEST_SHARE))
    tensors = torch.from_numpy(features), torch.from_numpy(ids), torch.from_numpy(labels)
    return Clicks(*(t[:cut] for t in tensors)), Clicks(*(t[cut:] for t in tensors))


def load_clicks(config: Any = None, argument: str | None = None) -> Splits:
    options = parse(argument)
    train, test = make_clicks(**options)
    spec = DataSpec(input_shape=(options["dense"],), num_classes=2, input_kind="clicks", tables=tuple(options["rows"]))
    return Splits(train=train, test=test, spec=spec, classes=("no click", "click"))
