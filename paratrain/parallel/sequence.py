"""Sequence parallelism: the activations between a transformer block's split layers held split by position
(Megatron-LM's, Korthikanti et al. 2022), for ``--sequence-parallel``.

Under tensor parallelism alone every process holds the whole residual stream, norms and dropout masks; split
by position each holds 1/T of them. A row-wise layer's all-reduce becomes a reduce-scatter and a column-wise
layer all-gathers its input first: the same bytes in two halves (parallel/tensor.py makes the transitions).
Styles: ``sequence`` for a module that works position by position (a norm, a dropout) on dimension 1 of
(batch, positions, features), its replicated parameters' gradients summed by DTensor; ``split_sequence``
where the split starts (after the embeddings). A model that takes the sequence length from a tensor now
split (a ``view(batch, length, ...)``) cannot run so; paratrain's gpt takes it from the projection itself.
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
