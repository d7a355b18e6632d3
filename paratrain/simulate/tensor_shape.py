"""What tensor parallelism and pipeline stages do to the user's model, for the simulator
(tensor.py, pipeline.py): the parameters a plan splits, the share of the compute in them,
the activations a step sends, and (pipeline) how the compute and parameters fall to each
stage and what crosses between stages; measured in one process on one local batch with the
model whole."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.simulate.pipeline import StageShape
from paratrain.simulate.tensor import Mesh, TensorShape


def measure(
    model: nn.Module, inputs: Any, plan: dict[str, str] | None, size: int, loss_parallel: bool = True
) -> TensorShape:
    """``model``'s TensorShape for a split ``size`` ways by ``plan`` (None: its own), from
    one forward pass on ``inputs`` (a local batch); the model is left as it was. With
    ``loss_parallel`` (train's ``--loss-parallel``, a cross-entropy loss) the output layer's
    logits are not gathered: the loss all-reduces a few values a position instead."""
    return measure_stages(model, inputs, [], plan, size, loss_parallel)[0].shape


def measure_stages(
    model: nn.Module,
    inputs: Any,
    starts: list[str],
    plan: dict[str, str] | None,
    size: int,
    loss_parallel: bool = True,
) -> list[StageShape]:
    """One StageShape for each part of ``model`` cut before the modules named ``starts`` (in
    the order the forward pass meets them; none: the model whole), each part split ``size``
    ways by ``plan`` (size 1: nothing split, no plan needed). A part's compute is the FLOPs
    counted from its first module's call to the next part's; its parameters are those of the
    modules it calls (a tied weight counts in each part that uses it, as each stage holds it)."""
    chosen: dict[str, Any] = {}
    if size > 1:
        from paratrain.parallel.tensor import output_layer, plan_for, planned, split_only  # deferred: DTensor

        # the modules split (sequence parallelism's are replicated: not modelled apart)
        chosen = split_only(planned(model, plan_for(model, plan), size))
    logits = output_layer(model, chosen) if chosen and loss_parallel else None
    parts = _Parts(model, starts, chosen, logits)
    with FlopCounterMode(display=False) as flops:
        parts.flops = flops
        try:
            _call(model, inputs)
        finally:
            parts.remove()
    return parts.shapes(size)


class _Parts:
    """The hooks that count, part by part, what one forward pass computes, holds and sends."""

    def __init__(self, model: nn.Module, starts: list[str], chosen: dict[str, Any], logits: str | None):
        modules = dict(model.named_modules())
        count = len(starts) + 1
        self.flops: FlopCounterMode | None = None
        self.part = 0
        self.starts = list(starts)
        self.begun = [0.0] * count  # the FLOPs counted when each part began
        self.split_flops = [0.0] * count
        self.boundary = [0.0] * count
        self.held: list[dict[int, tuple[float, bool]]] = [{} for _ in range(count)]
        self.reduced: list[list[float]] = [[] for _ in range(count)]
        self.gathered: list[list[float]] = [[] for _ in range(count)]
        self.split_called: list[set[str]] = [set() for _ in range(count)]
        self.called: set[str] = set()
        self.chosen = chosen
        split_ids = {id(p) for name in chosen for p in modules[name].parameters()}
        self.trainable = {id(p): (p.numel() * 4.0, id(p) in split_ids) for p in model.parameters() if p.requires_grad}
        outer = {name for name in chosen if not any(name.startswith(other + ".") for other in chosen)}
        self.entered: dict[str, float] = {}
        hooks = []
        for name, module in modules.items():
            if name in starts:
                hooks.append(module.register_forward_pre_hook(self._begin(starts.index(name) + 1), with_kwargs=True))
            if next(module.parameters(recurse=False), None) is not None:
                hooks.append(module.register_forward_pre_hook(self._holds))
            if name in outer:
                hooks.append(module.register_forward_pre_hook(self._enter(name)))
                hooks.append(module.register_forward_hook(self._leave(name)))
            if name in chosen:
                hooks.append(module.register_forward_hook(self._collectives(name, chosen[name], name == logits)))
        self.hooks = hooks

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _total(self) -> float:
        return float(self.flops.get_total_flops()) if self.flops is not None else 0.0

    def _begin(self, part: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.part = part
            self.called.add(self.starts[part - 1])
            self.begun[part] = self._total()
            crossing = [*args, *kwargs.values()]
            self.boundary[part] = sum(_bytes(t) for t in crossing if torch.is_tensor(t) and t.is_floating_point())

        return hook

    def _holds(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        for p in module.parameters(recurse=False):
            if id(p) in self.trainable:
                self.held[self.part][id(p)] = self.trainable[id(p)]

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self.entered[name] = self._total()

        return hook

    def _leave(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self.split_flops[self.part] += self._total() - self.entered.pop(name, self._total())

        return hook

    def _collectives(self, name: str, style: Any, split_logits: bool) -> Any:
        from paratrain.parallel.vocabulary import LOSS_ALL_REDUCES, LOSS_VALUE_BYTES  # deferred: DTensor

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            part = self.part
            self.split_called[part].add(name)
            out = output[0] if isinstance(output, (tuple, list)) else output
            if style.kind == "rowwise":
                self.reduced[part].append(_bytes(out))
            elif style.kind == "colwise":
                if args and torch.is_tensor(args[0]) and args[0].requires_grad:
                    self.reduced[part].append(_bytes(args[0]))  # its input's gradient, backward
                if split_logits:  # the loss's maximum, sum of exponentials and target logit
                    self.reduced[part].extend([out.numel() // out.shape[-1] * LOSS_VALUE_BYTES] * LOSS_ALL_REDUCES)
                elif style.gather:
                    self.gathered[part].append(_bytes(out))

        return hook

    def shapes(self, size: int) -> list[StageShape]:
        missing = [name for name in self.starts if name not in self.called]
        if missing:
            raise ConfigError(f"--split-points: {', '.join(missing)} is not called in the model's forward pass")
        seen = {key for part in self.held for key in part}
        self.held[0].update({key: value for key, value in self.trainable.items() if key not in seen})
        self.split_called[0] |= set(self.chosen) - set().union(*self.split_called)
        total = self._total()
        ends = [*self.begun[1:], total]
        found = []
        for k, held in enumerate(self.held):
            flops = ends[k] - self.begun[k]
            shape = TensorShape(
                size=size,
                split_bytes=sum(b for b, split in held.values() if split),
                whole_bytes=sum(b for b, split in held.values() if not split),
                split_share=min(self.split_flops[k] / flops, 1.0) if flops > 0 else 0.0,
                all_reduce_bytes=tuple(self.reduced[k]),
                all_gather_bytes=tuple(self.gathered[k]),
                modules=len(self.split_called[k]),
            )
            share = flops / total if total > 0 else 1.0 / len(self.held)
            found.append(StageShape(shape, compute_share=share, boundary_bytes=self.boundary[k]))
        return found


def _call(model: nn.Module, inputs: Any) -> Any:
    with torch.enable_grad():
        if isinstance(inputs, dict):
            return model(**inputs)
        return model(inputs)


def _bytes(tensor: Any) -> float:
    return float(tensor.numel() * tensor.element_size()) if torch.is_tensor(tensor) else 0.0


def first_inputs(splits: Any, batch_size: int) -> Any:
    """The inputs of the first local batch of ``splits``' training data (a dict batch whole)."""
    batch = next(iter(torch.utils.data.DataLoader(splits.train, batch_size=batch_size)))
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def counts(text: str, flag: str) -> list[int]:
    """A comma-separated list of counts >= 1 (``--tensor-parallel``, ``--stages``) read."""
    try:
        sizes = [int(t) for t in text.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{flag} must be counts >= 1, comma-separated, e.g. 2,4; got {text!r}") from None
    return sizes


def tensor_sizes(text: str) -> list[int]:
    """``--tensor-parallel`` read: the sizes T to compare."""
    return counts(text, "--tensor-parallel")


def split_link(args: Any) -> dict[str, Any]:
    """A mesh's options for the processes that split a layer, from the flags in engine units:
    their link (``--tp-bandwidth-gbps``, ``--tp-latency-us``) and each split module's cost."""
    return {
        "tp_bandwidth": None if args.tp_bandwidth_gbps is None else args.tp_bandwidth_gbps * 1e9 / 8,
        "tp_latency": None if args.tp_latency_us is None else args.tp_latency_us * 1e-6,
        "module_s": (args.tp_module_us or 0.0) * 1e-6,
    }


def meshes(args: Any, model: nn.Module, splits: Any) -> list[Mesh]:
    """``--strategy tensor``'s meshes: one per ``--tensor-parallel`` size, measured for
    ``model`` on the first local batch of ``splits``; the line that says what was measured."""
    from paratrain.strategies.tensor.config import TensorConfig  # deferred: reads --tp-plan as train does

    plan = TensorConfig(tp_plan=args.tp_plan).plan()
    inputs = first_inputs(splits, args.batch_size)
    found = []
    for size in tensor_sizes(args.tensor_parallel or "2"):
        shape = measure(model, inputs, plan, size, args.loss_parallel)
        found.append(
            Mesh(
                shape,
                size,
                shard_replicas=args.shard_replicas,
                units=args.fsdp_units,
                **split_link(args),
            )
        )
    console.print(found[-1].shape.describe(args.model))
    return found
