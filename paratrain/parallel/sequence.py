"""Sequence parallelism: the activations between a transformer block's split layers held
split by position (Megatron-LM's, Korthikanti et al. 2022), for ``--sequence-parallel``.

Under tensor parallelism alone, every process of a replica holds the whole of the
activations that its split layers do not produce split: the residual stream, the norms'
inputs and outputs, the dropouts' masks. Split by position instead, each holds 1/T of
them. The all-reduce after a row-wise layer becomes a reduce-scatter (each process keeps
the sum for its positions) and a column-wise layer all-gathers its input first: the same
bytes as the all-reduce, in two halves (parallel/tensor.py makes those transitions). What
runs between them runs on each process's positions:

- ``sequence``: a module that works position by position (a LayerNorm, an RMSNorm, a
  dropout): it takes and gives each process's slice, dimension 1 of (batch, positions,
  features); its parameters are replicated, and their gradients, each process's sum over
  its own positions, are summed over the processes by DTensor;
- ``split_sequence``: where the split starts: the module's whole output is cut, each
  process keeping its positions (its gradient all-gathered backward), e.g. after the
  embeddings, which need every position's id.

A model whose modules take the sequence length from a tensor that is now split (a
``view(batch, length, ...)`` of a whole projection) cannot run so; paratrain's gpt takes it
from the projection itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from paratrain.errors import ConfigError

#: The dimension split: positions, in (batch, positions, features).
POSITIONS = Shard(1)


def on_positions(module: nn.Module, mesh: DeviceMesh) -> None:
    """``module`` (style ``sequence``) runs on each process's positions: its parameters
    replicated DTensors, its first input taken as this process's slice, its output given as one."""

    def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            whole = distribute_tensor(param.data, mesh, [Replicate()])
            mod.register_parameter(pname, nn.Parameter(whole, param.requires_grad))

    def take(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        first = inputs[0]
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, [POSITIONS], run_check=False)
        return (first, *inputs[1:])

    distribute_module(module, mesh, replicate, take, lambda mod, out, mesh: _local(out))


def split_positions(module: nn.Module, mesh: DeviceMesh) -> None:
    """``module``'s whole output (style ``split_sequence``) cut by position: each process keeps
    its slice; a length that the processes do not divide is one line."""

    def cut(mod: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            return type(output)([cut(mod, inputs, output[0]), *output[1:]])
        size = mesh.size()
        if output.dim() < 2 or output.shape[1] % size:
            raise ConfigError(
                f"--sequence-parallel over {size} processes: {type(mod).__name__} gives "
                f"{tuple(output.shape)}, whose positions (dimension 1) {size} does not divide; give a "
                f"sequence length that is a multiple of {size} (--seq-len)"
            )
        whole = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
        return whole.redistribute(mesh, [POSITIONS]).to_local()

    module.register_forward_hook(cut)


def _local(output: Any) -> Any:
    if isinstance(output, (tuple, list)):
        return type(output)(_local(x) for x in output)
    return output.to_local() if isinstance(output, DTensor) else output
