"""A stacked RNN pipelined one layer per process over chunks of its sequence: the wavefront of the classic
multi-GPU tutorials.

Stage ``k`` holds layer ``k`` of an ``nn.LSTM``; the sequence is cut into ``C`` chunks and stage ``k`` computes
chunk ``t`` while stage ``k + 1`` computes chunk ``t - 1``. States carry over between a stage's chunks and every
chunk's graph is kept until its backward, which runs the same wave the other way, so outputs and gradients
are the unsplit LSTM's (no truncation). With equal chunks each pass has the bubble ``(S - 1) / (C + S - 1)``,
measured per stage by ``busy_seconds``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.transport import wire_device
from paratrain.errors import ConfigError


@dataclass
class WavefrontParts:
    """How a model splits for the wavefront (its ``wavefront_parts()`` gives them):
    ``front`` makes the first layer's inputs ``(batch, length, features)`` from the batch's,
    ``lstm`` is the stacked ``nn.LSTM`` (one layer a stage), ``back`` makes the logits from
    the last layer's outputs ``(batch, length, hidden)``, ``length`` reads the sequence
    length off the batch's inputs; ``front_modules`` and ``back_modules`` hold the
    parameters of ``front`` and ``back`` (on the first and the last stage)."""

    front: Any
    lstm: nn.LSTM
    back: Any
    length: Any
    front_modules: list[nn.Module] = field(default_factory=list)
    back_modules: list[nn.Module] = field(default_factory=list)


def check_lstm(lstm: nn.LSTM) -> None:
    """ConfigError for an LSTM whose layers the wavefront cannot take one by one."""
    if lstm.bidirectional or lstm.proj_size or not lstm.batch_first:
        raise ConfigError("the wavefront splits a unidirectional batch_first nn.LSTM without projections")


def layer_of(lstm: nn.LSTM, k: int) -> nn.LSTM:
    """Layer ``k`` of ``lstm`` as a single-layer ``nn.LSTM`` whose parameters *are* that
    layer's (the same Parameter objects: an optimizer over the model steps them)."""
    check_lstm(lstm)
    size = lstm.input_size if k == 0 else lstm.hidden_size
    layer = nn.LSTM(size, lstm.hidden_size, batch_first=True, bias=lstm.bias, device="meta")
    for name in ("weight_ih", "weight_hh", *(("bias_ih", "bias_hh") if lstm.bias else ())):
        setattr(layer, f"{name}_l0", getattr(lstm, f"{name}_l{k}"))
    return layer


def split_lstm(lstm: nn.LSTM) -> list[nn.LSTM]:
    """One single-layer ``nn.LSTM`` per layer of ``lstm``, with its weights (copies)."""
    return [copy.deepcopy(layer_of(lstm, k)) for k in range(lstm.num_layers)]


@dataclass
class _Chunk:
    inputs: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor]  # leaves: their gradients go to the chunk before
    outputs: torch.Tensor
    final: tuple[torch.Tensor, torch.Tensor]


@dataclass
class WavefrontStage:
    """Stage ``stage`` of ``ranks`` (global ranks, one per layer, in layer order) running
    ``layer`` over ``chunks`` chunks of each sequence; ``group``: the process group the
    ranks belong to (None: the default one)."""

    layer: nn.LSTM
    stage: int
    ranks: list[int]
    chunks: int
    group: Any = None
    busy_seconds: float = 0.0
    """Seconds this stage computed (its layer, forward and backward) since it was made."""
    bytes_sent: int = 0
    _saved: list[_Chunk] = field(default_factory=list)
    _sends: list[Any] = field(default_factory=list)
    _made: torch.Tensor | None = None  # the first stage's inputs, as given (with their graph)
    _leaf: torch.Tensor | None = None  # the same, detached: the chunks are its slices

    @property
    def device(self) -> torch.device:
        """Where the layer computes."""
        return self.layer.weight_ih_l0.device

    @property
    def wire(self) -> torch.device:
        """Where what crosses between stages is sent from and received into: the GPU under
        NCCL; host memory under Gloo, whose send and receive take CPU tensors only."""
        return wire_device(self.device, self.group)

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def bounds(self, length: int) -> list[tuple[int, int]]:
        """The chunks' [start, stop) along time: ``chunks`` nearly equal runs."""
        cuts = [length * c // self.chunks for c in range(self.chunks + 1)]
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def forward(self, inputs: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
        """The forward wave. The first stage gives its ``inputs`` ``(batch, length, features)``
        (they may carry a graph: an embedding's gradient flows back into it); the others
        receive theirs chunk by chunk. Returns the layer's outputs on the last stage (their
        gradient goes to ``backward``), None elsewhere."""
        self._wait_sends()
        self._saved = []
        if self.is_first:
            # one leaf the chunks are cut from: what made the inputs takes its gradient once
            self._made = inputs if inputs.requires_grad else None
            inputs = inputs.detach().requires_grad_(self._made is not None)
            self._leaf = inputs
        hidden = self.layer.hidden_size
        device = self.device
        wire = self.wire
        zeros = torch.zeros(1, batch, hidden, device=device)
        state = (zeros, zeros)
        outputs = []
        for start, stop in self.bounds(length):
            if self.is_first:
                x = inputs[:, start:stop]
            else:
                x = torch.empty(batch, stop - start, self.layer.input_size, device=wire)
                dist.recv(x, src=self.ranks[self.stage - 1], group=self.group)
                x = x.to(device).requires_grad_(True)
            h0, c0 = (s.detach().requires_grad_(True) for s in state)
            began = time.perf_counter()
            out, final = self.layer(x, (h0, c0))
            self.busy_seconds += time.perf_counter() - began
            self._saved.append(_Chunk(x, (h0, c0), out, final))
            if not self.is_last:
                self._send(out.detach().to(wire).contiguous(), self.ranks[self.stage + 1])
            outputs.append(out)
            state = final
        return torch.cat(outputs, dim=1) if self.is_last else None

    def backward(self, grad_outputs: torch.Tensor | None = None) -> None:
        """The backward wave: the last stage gives the gradient of its outputs ``(batch,
        length, hidden)``; the others receive theirs chunk by chunk from the stage above.
        The layer's parameters (and, on the first stage, whatever made its inputs) gather
        their gradients."""
        self._wait_sends()
        wire = self.wire
        grad_state: tuple[torch.Tensor, torch.Tensor] | None = None
        offset = sum(chunk.outputs.shape[1] for chunk in self._saved)
        for chunk in reversed(self._saved):
            offset -= chunk.outputs.shape[1]
            if self.is_last:
                grad = grad_outputs[:, offset : offset + chunk.outputs.shape[1]]
            else:
                grad = torch.empty(chunk.outputs.shape, device=wire)
                dist.recv(grad, src=self.ranks[self.stage + 1], group=self.group)
                grad = grad.to(chunk.outputs.device)
            tensors, grads = [chunk.outputs], [grad]
            if grad_state is not None:
                tensors += list(chunk.final)
                grads += list(grad_state)
            began = time.perf_counter()
            torch.autograd.backward(tensors, grads)
            self.busy_seconds += time.perf_counter() - began
            grad_state = (chunk.state[0].grad, chunk.state[1].grad)
            if not self.is_first:
                self._send(chunk.inputs.grad.to(wire).contiguous(), self.ranks[self.stage - 1])
        self._saved = []
        if self.is_first and self._made is not None and self._leaf.grad is not None:
            torch.autograd.backward(self._made, self._leaf.grad)
        self._made = self._leaf = None
        self._wait_sends()

    def _send(self, tensor: torch.Tensor, rank: int) -> None:
        self._sends.append(dist.isend(tensor, dst=rank, group=self.group))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work in sends:
            work.wait()


def bubble(stages: int, chunks: int) -> float:
    """The idle share of each stage in a pass over ``chunks`` equal chunks: (S - 1) / (C + S - 1)."""
    return (stages - 1) / (chunks + stages - 1)
