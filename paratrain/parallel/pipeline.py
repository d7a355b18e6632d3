"""Pipeline parallelism across processes: one stage of a model per process, micro-batches flowing through the
stages on ``torch.distributed.pipelining``.

The split comes from ``split.py`` for an nn.Sequential and from ``traced.py`` for any other model; the schedule
is PyTorch's: GPipe (Huang et al. 2019) or 1F1B (PipeDream-Flush, Narayanan et al. 2021), which keeps about
``num_stages`` micro-batches of activations instead of all. Both scale gradients by ``1 / num_microbatches``,
so a step's gradients equal the whole batch's with a mean loss. Evaluation runs a plain forward pass
(``forward_only``): its batch sizes vary, and the schedules fix their buffers' shapes at the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.split import Bounds

#: ``--schedule`` names -> torch.distributed.pipelining schedule classes (imported on use:
#: torch.distributed.pipelining imports sympy, which takes seconds).
SCHEDULES: dict[str, str] = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "wavefront": "paratrain's own"}
"""``wavefront`` is paratrain's own (parallel/wavefront.py): a stacked RNN one layer a stage,
its micro-batches chunks of the sequence along time."""

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
_MAX_DIMS = 8


def stage_module(layers: list[nn.Module], bounds: Bounds, stage: int) -> nn.Sequential:
    """The layers of ``stage`` as one module (the same layer objects, not copies)."""
    start, stop = bounds[stage]
    return Stage(*layers[start:stop])


class Stage(nn.Sequential):
    """A stage's layers, whose activations and input gradients leave it contiguous: what
    crosses to a neighbour is sent as it is, and c10d sends only contiguous tensors (a
    conv net in channels-last order makes NHWC activations). The state_dict keys are a
    plain Sequential's."""

    def forward(self, x: Any) -> Any:
        out = super().forward(_Contiguous.apply(x) if torch.is_tensor(x) else x)
        return _Contiguous.apply(out) if torch.is_tensor(out) else out


class _Contiguous(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def make_schedule(
    name: str,
    module: nn.Module,
    stage: int,
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """PyTorch's PipelineStage for ``module`` and the named schedule driving it.

    The stage learns its input and output shapes at the first step (one exchange of
    shapes between neighbours), so no example batch is needed here."""
    from torch.distributed import pipelining

    if device.type != "cpu" and _is_gloo(group):
        # Stages that share a GPU talk over Gloo, which sends host memory only: the stage's
        # buffers are on the CPU, its module moves what crosses to and from the GPU, and the
        # last stage's loss is taken in host memory.
        module, device = HostBoundary(module, device), torch.device("cpu")
        loss_fn = _on_outputs_device(loss_fn)
    pipeline_stage = pipelining.PipelineStage(module, stage, num_stages, device, group=group)
    schedule = getattr(pipelining, SCHEDULES[name])
    return schedule(pipeline_stage, n_microbatches=num_microbatches, loss_fn=loss_fn)


class HostBoundary(nn.Module):
    """A stage computing on ``device`` whose inputs arrive, and whose outputs leave, in host
    memory; autograd carries the gradients back across."""

    def __init__(self, module: nn.Module, device: torch.device):
        super().__init__()
        self.module, self.device = module, device

    def forward(self, *inputs: torch.Tensor) -> Any:
        outputs = self.module(*(x.to(self.device) for x in inputs))
        if isinstance(outputs, tuple):
            return tuple(x.to("cpu") for x in outputs)
        return outputs.to("cpu")


def _on_outputs_device(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    return lambda outputs, targets: loss_fn(outputs, targets.to(outputs.device))


def forward_only(
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    stage: int,
    num_stages: int,
    previous_rank: int | None,
    next_rank: int | None,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """One forward pass of a whole batch through the stages, without a schedule.

    Stage 0 reads ``inputs``; every other stage receives its inputs (the tensors the stage
    before returned) from the previous stage, each after a small header with its dtype and
    shape, so batches may vary in size. Returns the outputs on the last stage, None on the
    others."""
    buffer_device = torch.device("cpu") if _is_gloo(group) else device  # Gloo moves host memory
    if stage > 0:
        count = torch.zeros(1, dtype=torch.int64, device=buffer_device)
        dist.recv(count, src=previous_rank, group=group)
        inputs = tuple(_receive(previous_rank, group, buffer_device).to(device) for _ in range(int(count)))
    outputs = module(*inputs)
    if stage == num_stages - 1:
        return outputs
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    dist.send(torch.tensor([len(outputs)], dtype=torch.int64, device=buffer_device), dst=next_rank, group=group)
    for tensor in outputs:
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=buffer_device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, device=buffer_device)
        dist.send(header, dst=next_rank, group=group)
        payload = tensor.detach().cpu() if _is_gloo(group) else tensor.detach()
        dist.send(payload.contiguous(), dst=next_rank, group=group)
    return None


def _receive(source: int | None, group: dist.ProcessGroup | None, buffer_device: torch.device) -> torch.Tensor:
    header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=buffer_device)
    dist.recv(header, src=source, group=group)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=buffer_device)
    dist.recv(tensor, src=source, group=group)
    return tensor


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"
