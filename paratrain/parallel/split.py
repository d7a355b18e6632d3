"""Where to cut a sequential model into consecutive parts (stages, device groups).

A part is a half-open range of layer indices ``[start, stop)``; a split is the list
of those ranges, in order, covering every layer once, none empty. Three ways to pick
it: by parameter count (memory), by measured time per layer (throughput), or at the
split points the user names. The balanced split minimises the largest part's cost
(the linear-partition problem, solved exactly by dynamic programming: a pipeline runs
at the pace of its slowest stage, GPipe, Huang et al. 2019).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from paratrain.errors import ConfigError

Bounds = list[tuple[int, int]]


def sequential_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a sequential model, in order; ConfigError for any other module."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pipeline and placement split an nn.Sequential into consecutive layers; "
            f"got {type(model).__name__} (use a sequential model, e.g. --model mlp or cifar_cnn)"
        )
    return list(model)


def check_num_parts(num_layers: int, num_parts: int, what: str = "--stages") -> None:
    if num_parts < 1:
        raise ConfigError(f"{what} must be >= 1, got {num_parts}")
    if num_parts > num_layers:
        raise ConfigError(
            f"{what} {num_parts} is more than the model's {num_layers} layers; every stage needs at least one layer"
        )


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameters per layer (what a stage holds in memory, weights and optimizer state)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def time_costs(layers: Sequence[nn.Module], example: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward plus backward per layer on ``example``, the best of ``repeats``."""
    costs = [float("inf")] * len(layers)
    for _ in range(repeats):
        x = example
        for i, layer in enumerate(layers):
            x = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.sum().backward()
            costs[i] = min(costs[i], time.perf_counter() - start)
            x = y
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return costs


#: How a split may balance the stages (``--balance``).
BALANCES = ("params", "time")


def layer_costs(layers: Sequence[nn.Module], balance: str, example: torch.Tensor | None = None) -> list[float]:
    if balance == "params":
        return parameter_costs(layers)
    if balance == "time":
        if example is None:
            raise ValueError("balance by time needs an example batch")
        return time_costs(layers, example)
    raise ConfigError(f"--balance must be params or time, got {balance!r}")


def balanced_bounds(costs: Sequence[float], num_parts: int) -> Bounds:
    """Consecutive, non-empty parts minimising the largest part's total cost.

    Ties go to the split whose parts are closest in number of layers, so layers
    without parameters (activations, flatten) spread instead of piling up at one end.
    """
    n = len(costs)
    check_num_parts(n, num_parts)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ideal = n / num_parts
    inf = (float("inf"), float("inf"))
    # best[k][i]: (largest cost, layer-count imbalance) splitting the first i layers in k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                score = (max(prev[0], prefix[i] - prefix[j]), prev[1] + abs((i - j) - ideal))
                if score < best[k][i]:
                    best[k][i], cut[k][i] = score, j
    bounds, i = [], n
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def parameter_bounds(layers: Sequence[nn.Module], num_parts: int, points: Sequence[int] | None = None) -> Bounds:
    """The split at ``points`` (layer indices where parts start) when given, else the layers
    balanced by parameter count."""
    if points is not None:
        return bounds_from_split_points(points, len(layers), num_parts)
    return balanced_bounds(layer_costs(layers, "params"), num_parts)


def parse_split_points(text: str) -> list[int] | list[str]:
    """``--split-points``: layer indices of an nn.Sequential (``3,7``), or the names of the
    modules where stages start in any other model (``transformer.h.2``: traced.py)."""
    points = [p.strip() for p in text.split(",") if p.strip()]
    if not points:
        raise ConfigError(f"--split-points must name at least one layer index or module, e.g. 3,7; got {text!r}")
    numbers = [p.lstrip("-").isdigit() for p in points]
    if all(numbers):
        return [int(p) for p in points]
    if any(numbers):
        raise ConfigError(
            f"--split-points must be all layer indices (3,7) or all module names (transformer.h.2); got {text!r}"
        )
    return points


def bounds_from_split_points(points: Sequence[int], num_layers: int, num_parts: int | None = None) -> Bounds:
    """Parts that start at each split point: ``[3, 7]`` on 10 layers -> [0,3), [3,7), [7,10)."""
    edges = [0, *points, num_layers]
    if num_parts is not None and len(points) != num_parts - 1:
        raise ConfigError(
            f"--split-points {','.join(map(str, points))} makes {len(points) + 1} stages, but --stages is {num_parts}"
        )
    for a, b in zip(edges, edges[1:]):
        if not a < b:
            raise ConfigError(
                f"--split-points {','.join(map(str, points))} leaves a stage empty: points must increase "
                f"strictly between 1 and {num_layers - 1} (the model has {num_layers} layers)"
            )
    return list(zip(edges, edges[1:]))
