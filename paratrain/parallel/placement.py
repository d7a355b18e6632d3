"""Layer placement on one process: consecutive layers of a sequential model on
several devices, activations moved between them (naive model parallelism).

    model = paratrain.parallel.place(model, devices=["cuda:0", "cuda:1"])
    logits = model(x)            # x on any device; logits on the last device

Only one device works at a time (no micro-batches): this is about fitting a model
that one device cannot hold, not about speed. For overlap, use the ``pipeline``
strategy. CPU "devices" (``["cpu", "cpu"]``) run the same code, for tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paratrain.parallel.split import Bounds, balanced_bounds, parameter_costs, sequential_layers


class PlacedSequential(nn.Module):
    """The parts of a split sequential model, each on its device."""

    def __init__(self, parts: Sequence[nn.Module], devices: Sequence[torch.device], bounds: Bounds):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.devices = list(devices)
        self.bounds = list(bounds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part, device in zip(self.parts, self.devices):
            # Autograd carries the gradient back across the copy.
            x = part(x.to(device, non_blocking=True))
        return x

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]


def place(model: nn.Module, devices: Sequence[str | torch.device], bounds: Bounds | None = None) -> PlacedSequential:
    """``model``'s layers in consecutive groups, one per device, balanced by parameter count
    (or at ``bounds``: ``[(start, stop), ...]`` layer ranges). The layers are moved, not copied."""
    layers = sequential_layers(model)
    devices = [torch.device(d) for d in devices]
    if bounds is None:
        bounds = balanced_bounds(parameter_costs(layers), len(devices))
    parts = [nn.Sequential(*layers[a:b]).to(device) for (a, b), device in zip(bounds, devices)]
    return PlacedSequential(parts, devices, bounds)
