"""What tensor parallelism does to the user's model, for the simulator (tensor.py): the
parameters a plan splits, the share of the compute in them, and the activations a step
sends, measured in one process on one local batch with the model whole."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.simulate.tensor import Mesh, TensorShape


def measure(
    model: nn.Module, inputs: Any, plan: dict[str, str] | None, size: int, loss_parallel: bool = True
) -> TensorShape:
    """``model``'s TensorShape for a split ``size`` ways by ``plan`` (None: its own), from
    one forward pass on ``inputs`` (a local batch); the model is left as it was. With
    ``loss_parallel`` (train's ``--loss-parallel``, a cross-entropy loss) the output layer's
    logits are not gathered: the loss all-reduces a few values a position instead."""
    from paratrain.parallel.tensor import (
        output_layer,
        plan_for,
        planned,
        split_only,
    )  # deferred: DTensor, only for tensor
    from paratrain.parallel.vocabulary import LOSS_ALL_REDUCES, LOSS_VALUE_BYTES

    # the modules split (sequence parallelism's are replicated: not modelled apart)
    chosen = split_only(planned(model, plan_for(model, plan), size))
    logits = output_layer(model, chosen) if loss_parallel else None
    modules = dict(model.named_modules())
    split_ids = {id(p) for name in chosen for p in modules[name].parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    split_bytes = float(sum(p.numel() * 4 for p in trainable if id(p) in split_ids))
    whole_bytes = float(sum(p.numel() * 4 for p in trainable if id(p) not in split_ids))
    reduced: list[float] = []
    gathered: list[float] = []

    def counter(style: Any, split_logits: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if style.kind == "rowwise":
                reduced.append(_bytes(out))
            elif style.kind == "colwise":
                if args and torch.is_tensor(args[0]) and args[0].requires_grad:
                    reduced.append(_bytes(args[0]))  # its input's gradient, backward
                if split_logits:  # the loss's maximum, sum of exponentials and target logit
                    reduced.extend([out.numel() // out.shape[-1] * LOSS_VALUE_BYTES] * LOSS_ALL_REDUCES)
                elif style.gather:
                    gathered.append(_bytes(out))

        return hook

    hooks = [modules[name].register_forward_hook(counter(style, name == logits)) for name, style in chosen.items()]
    try:
        with FlopCounterMode(display=False) as flops:
            _call(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return TensorShape(
        size=size,
        split_bytes=split_bytes,
        whole_bytes=whole_bytes,
        split_share=_split_share(flops.get_flop_counts(), set(chosen)),
        all_reduce_bytes=tuple(reduced),
        all_gather_bytes=tuple(gathered),
        modules=len(chosen),
    )


def _call(model: nn.Module, inputs: Any) -> Any:
    with torch.enable_grad():
        if isinstance(inputs, dict):
            return model(**inputs)
        return model(inputs)


def _bytes(tensor: Any) -> float:
    return float(tensor.numel() * tensor.element_size()) if torch.is_tensor(tensor) else 0.0


def _split_share(counts: dict[str, dict[Any, int]], chosen: set[str]) -> float:
    """The share of the FLOPs counted under ``chosen`` modules (FlopCounterMode names a module
    by its root's class and its path: ``GPT.1.mlp.0``), each counted once (a heads-split
    attention holds its split projections)."""
    total = sum(counts.get("Global", {}).values())
    if not total:
        return 0.0
    by_path = {key.partition(".")[2]: sum(ops.values()) for key, ops in counts.items() if "." in key}
    outer = [name for name in chosen if not any(name.startswith(other + ".") for other in chosen)]
    return min(sum(by_path.get(name, 0) for name in outer) / total, 1.0)


def first_inputs(splits: Any, batch_size: int) -> Any:
    """The inputs of the first local batch of ``splits``' training data (a dict batch whole)."""
    batch = next(iter(torch.utils.data.DataLoader(splits.train, batch_size=batch_size)))
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def tensor_sizes(text: str) -> list[int]:
    """``--tensor-parallel`` read: the sizes T to compare, each >= 1."""
    try:
        sizes = [int(t) for t in text.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--tensor-parallel must be counts >= 1, comma-separated, e.g. 2,4; got {text!r}") from None
    return sizes


def meshes(args: Any, model: nn.Module, splits: Any) -> list[Mesh]:
    """``--strategy tensor``'s meshes: one per ``--tensor-parallel`` size, measured for
    ``model`` on the first local batch of ``splits``; the line that says what was measured."""
    from paratrain.strategies.tensor.config import TensorConfig  # deferred: reads --tp-plan as train does

    plan = TensorConfig(tp_plan=args.tp_plan).plan()
    inputs = first_inputs(splits, args.batch_size)
    found = []
    for size in tensor_sizes(args.tensor_parallel):
        shape = measure(model, inputs, plan, size, args.loss_parallel)
        found.append(
            Mesh(
                shape,
                size,
                shard_replicas=args.shard_replicas,
                tp_bandwidth=None if args.tp_bandwidth_gbps is None else args.tp_bandwidth_gbps * 1e9 / 8,
                tp_latency=None if args.tp_latency_us is None else args.tp_latency_us * 1e-6,
                module_s=(args.tp_module_us or 0.0) * 1e-6,
                units=args.fsdp_units,
            )
        )
    console.print(found[-1].shape.describe(args.model))
    return found
