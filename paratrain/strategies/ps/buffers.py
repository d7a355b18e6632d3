"""A parameter-server worker's model as two flat buffers: its parameters and gradients
become views into them (DDP's bucket-view idea), so a pull is one receive per shard
straight into the model and a push sends slices of the gradient without a copy. On a GPU
the wire goes through pinned host copies; with 16-bit pulls the parameters land in a
buffer of their own first."""

from __future__ import annotations

import torch
from torch import nn


class FlatParameters:
    def __init__(self, params: list[nn.Parameter], device: torch.device, pull_dtype: torch.dtype):
        self.params = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0, device=device)
        """Every trainable parameter, in model order; the model's parameters are views of it."""
        self.grads = torch.zeros_like(self.params)
        """Their gradients, likewise (the backward pass accumulates into it)."""
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.params[offset : offset + n].view_as(p)
            p.grad = self.grads[offset : offset + n].view_as(p)
            offset += n
        on_host = device.type == "cpu"
        self.host = self.params if on_host else torch.empty_like(self.params, device="cpu").pin_memory()
        self.host_grads = self.grads if on_host else torch.empty_like(self.params, device="cpu").pin_memory()
        self.pulled = self.host if pull_dtype == self.params.dtype else torch.zeros_like(self.host, dtype=pull_dtype)
        """Where the shards' replies land (in the pull dtype)."""

    def gradients_to_send(self) -> torch.Tensor:
        """The gradient in host memory, ready for the wire."""
        if self.host_grads is not self.grads:
            self.host_grads.copy_(self.grads)
        return self.host_grads

    def take_pulled(self) -> None:
        """Put the parameters of the last reply into the model."""
        if self.pulled is not self.host:
            self.host.copy_(self.pulled)
        if self.host is not self.params:
            self.params.copy_(self.host, non_blocking=True)

    def pull_ratio(self) -> float:
        """Bytes on the wire per byte of parameters, for a pull."""
        return self.pulled.element_size() / self.params.element_size()
