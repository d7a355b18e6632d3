"""Tensor parallelism: each layer a plan names is split over the processes of a mesh dimension, every
process computing a slice of it (Megatron-LM's split, through DTensor).

A *plan* maps module names (``*`` for one part of a name: ``"transformer.h.*.mlp.c_fc"``) to styles:
``colwise`` splits a layer's outputs (``colwise:K`` for K packed projections, ``colwise_rep`` gathers them
whole again), ``rowwise`` its inputs with one all-reduce of the partial outputs (the rows of an
``nn.Embedding``), ``heads`` rescales an attention module's head counts, ``replicate`` keeps a module whole;
transformers' names are accepted too. A block is split column-then-row, so it costs two all-reduces forward
and two backward and the activations between stay split. Other parameters are replicated DTensors (one kind
of tensor for optimizers and clipping); a tied parameter is split only where every holder splits it alike.

A model's plan is the one given, else the model's own ``_tp_plan`` (paratrain's ``gpt``; a Hugging Face
model's ``base_model_tp_plan``), else the plans below (GPT-2). docs/tensor_parallel.md has more.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from paratrain.errors import ConfigError
from paratrain.parallel.sequence import POSITIONS, split_positions
from paratrain.parallel.sequence import on_positions as on_positions_of
from paratrain.parallel.vocabulary import logits_out
from paratrain.versions import require_torch

STYLES = ("colwise", "colwise:K", "colwise_rep", "rowwise", "heads", "sequence", "split_sequence", "replicate")

#: The styles of sequence parallelism (parallel/sequence.py): in effect with it alone.
SEQUENCE_STYLES = ("sequence", "split_sequence")

#: transformers' names for the styles above (its models' plans use them).
ALIASES = {"embedding_rowwise": "rowwise", "embedding_colwise": "colwise"}

#: Plans for models that carry none, by their config's ``model_type``.
KNOWN_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "transformer.wte": "rowwise",
        "transformer.h.*.attn": "heads",
        "transformer.h.*.attn.c_attn": "colwise:3",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_rep",
    },
}

#: Attributes of an attention module that count its heads or their width ("heads").
HEAD_ATTRIBUTES = ("num_heads", "n_head", "split_size", "embed_dim")


@dataclass(frozen=True)
class Style:
    """How one module is split: ``kind`` colwise, rowwise or heads; ``packed`` projections
    in one layer (colwise); ``gather``: the outputs made whole again (colwise)."""

    kind: str
    packed: int = 1
    gather: bool = False

    @staticmethod
    def parse(text: str, where: str) -> Style | None:
        """The style ``text`` names (None: the module stays whole); transformers' names too."""
        name, _, count = text.partition(":")
        name = ALIASES.get(name, name)
        if name == "replicate" and not count:
            return None
        if name == "packed_colwise" and not count:
            return Style("colwise", 2)
        if name in ("colwise_rep", "colwise_gather_output"):
            return Style("colwise", gather=True)
        if name == "colwise" and (not count or count.isdigit() and int(count) >= 1):
            return Style("colwise", int(count or 1))
        if name in ("rowwise", "heads", "sequence", "split_sequence") and not count:
            return Style(name)
        raise ConfigError(f"tensor-parallel plan: {where} has style {text!r}; the styles are {', '.join(STYLES)}")


def plan_for(model: nn.Module, given: dict[str, str] | None = None) -> dict[str, str]:
    """The plan tensor parallelism applies to ``model`` (module pattern -> style)."""
    if given:
        return dict(given)
    own = getattr(model, "_tp_plan", None) or {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        return {**{prefix + key: style for key, style in base.items()}, **own}
    if own:
        return dict(own)
    known = KNOWN_PLANS.get(getattr(config, "model_type", None) or "")
    if known:
        return dict(known)
    raise ConfigError(
        f"tensor parallelism needs a plan for {type(model).__name__}: it carries none (no _tp_plan, no "
        "base_model_tp_plan in its config); give one, module pattern to style, e.g. "
        '--tp-plan \'{"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}\''
    )


def matching(model: nn.Module, plan: dict[str, str], size: int) -> dict[str, Style]:
    """Each module of ``model`` the plan names, with its style; ConfigError for a pattern
    that names no module, or a module that cannot be split ``size`` ways."""
    patterns = {key: re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$") for key in plan}
    chosen: dict[str, Style] = {}
    for key, style_text in plan.items():
        style = Style.parse(style_text, repr(key))
        names = [name for name, _ in model.named_modules() if name and patterns[key].match(name)]
        if not names:
            raise ConfigError(f"tensor-parallel plan: {key!r} names no module of {type(model).__name__}")
        for name in names:
            if style is None:
                chosen.pop(name, None)
            else:
                chosen[name] = style
    modules = dict(model.named_modules())
    for name, style in chosen.items():
        if style.kind in SEQUENCE_STYLES:
            continue  # any module: it runs on each process's positions (parallel/sequence.py)
        if style.kind != "heads" and _layer_kind(modules[name]) is None:
            raise ConfigError(
                f"tensor-parallel plan: {name} is a {type(modules[name]).__name__}; {style.kind} splits "
                "nn.Linear, nn.Embedding and transformers' Conv1D"
            )
        if style.kind == "heads":
            _local_heads(copy.copy(modules[name]), name, size)  # checked on a copy: divided when split
        else:
            _check_divisible(modules[name], name, style, size)
    return chosen


def planned(model: nn.Module, plan: dict[str, str], size: int) -> dict[str, Style]:
    """The modules ``parallelize`` splits ``size`` ways, with their styles: ``matching``'s,
    less those that would split a tied parameter unlike another module holding it."""
    return _untie_conflicts(model, matching(model, plan, size), size)


def split_only(chosen: dict[str, Style]) -> dict[str, Style]:
    """``chosen`` less the modules sequence parallelism runs on positions (their parameters
    stay whole): the modules split, or whose heads are counted."""
    return {name: style for name, style in chosen.items() if style.kind not in SEQUENCE_STYLES}


def summary(chosen: dict[str, Style]) -> str:
    """How many modules of each kind ``chosen`` holds: ``5 colwise, 5 rowwise``."""
    counts: dict[str, int] = {}
    for style in chosen.values():
        counts[style.kind] = counts.get(style.kind, 0) + 1
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: dict[str, str], sequence: bool = False) -> dict[str, Style]:
    """Split ``model`` in place over ``mesh`` (one dimension) as ``plan`` says; every
    parameter it leaves whole becomes a replicated DTensor. ``sequence``: the plan's
    ``sequence`` and ``split_sequence`` modules hold the activations split by position
    (parallel/sequence.py), which the split layers then gather and scatter; without it
    those entries leave their modules whole. Returns the modules split."""
    size = mesh.size()
    chosen = planned(model, plan, size)
    on_positions = {name: style for name, style in chosen.items() if style.kind in SEQUENCE_STYLES}
    chosen = split_only(chosen)
    packed = [name for name, style in chosen.items() if style.packed > 1]
    if packed:
        with_sequence = " with --sequence-parallel" if sequence else ""
        require_torch(
            (2, 13) if sequence else (2, 12), f"tensor parallelism of packed projections ({packed[0]}){with_sequence}"
        )
    if sequence and not any(style.kind == "split_sequence" for style in on_positions.values()):
        raise ConfigError(
            f"--sequence-parallel: the plan of {type(model).__name__} names no module whose output to split by "
            'position ("split_sequence", where the split starts) and which modules run on the positions '
            '("sequence": norms, dropouts); give them in the plan (--tp-plan)'
        )
    ties = _ties(model)
    modules = dict(model.named_modules())
    logits = output_layer(model, chosen)
    for name, style in chosen.items():
        module = modules[name]
        if style.kind == "heads":
            _local_heads(module, name, size)
        else:
            _split(module, mesh, style, logits=name == logits, sequence=sequence)
    for name, style in on_positions.items() if sequence else ():
        (split_positions if style.kind == "split_sequence" else on_positions_of)(modules[name], mesh)
    for module in model.modules():  # the rest: replicated, their inputs and outputs whole
        own = list(module.named_parameters(recurse=False))
        if own and not any(isinstance(param, DTensor) for _, param in own):
            distribute_module(module, mesh, _replicated, _replicated_inputs, _outputs_as(None))
    for holders in ties:  # every holder of a tied parameter holds the first holder's again
        first_module, first_name = holders[0]
        shared = getattr(first_module, first_name)
        for module, pname in holders[1:]:
            setattr(module, pname, shared)
    return chosen


def output_layer(model: nn.Module, chosen: dict[str, Style]) -> str | None:
    """The module of ``chosen`` whose outputs are the model's logits, where the plan gathers
    them (``colwise_rep``): the model's last layer (registered last, as GPT-2's, Llama's and
    paratrain's gpt's output layers are). Inside ``vocabulary.split_logits()`` it gives them
    split by vocabulary."""
    layers = [name for name, module in model.named_modules() if _layer_kind(module)]
    style = chosen.get(layers[-1]) if layers else None
    return layers[-1] if style is not None and style.gather else None


def divide_heads(module: nn.Module, name: str, size: int) -> None:
    """``heads``: ``module`` counts the heads of one process of ``size``, as ``parallelize``
    makes it (a model traced into pipeline stages is traced so: parallel/tensor_stages.py)."""
    _local_heads(module, name, size)


# ----- one module ----------------------------------------------------------------------------------
def _layer_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers: weight (in, out)
        return "conv1d"
    return None


def _dims(module: nn.Module) -> tuple[int, int]:
    """(output dimension, input dimension) of ``module.weight``; an embedding's rows are its inputs."""
    return {"linear": (0, 1), "conv1d": (1, 0), "embedding": (1, 0)}[_layer_kind(module)]


def _placements(module: nn.Module, style: Style) -> dict[str, Placement]:
    out_dim, in_dim = _dims(module)
    if style.kind == "colwise":
        split = Shard(out_dim) if style.packed == 1 else _StridedShard(out_dim, split_factor=style.packed)
        bias = Shard(0) if style.packed == 1 else _StridedShard(0, split_factor=style.packed)
        return {"weight": split, "bias": bias}
    return {"weight": Shard(in_dim), "bias": Replicate()}


def _check_divisible(module: nn.Module, name: str, style: Style, size: int) -> None:
    out_dim, in_dim = _dims(module)
    dim = out_dim if style.kind == "colwise" else in_dim
    width = module.weight.shape[dim]
    if width % (size * style.packed):
        what = "rows" if _layer_kind(module) == "embedding" and dim == in_dim else "features"
        raise ConfigError(
            f"tensor parallelism over {size} processes: {name} has {width} "
            f"{'output' if dim == out_dim else 'input'} {what}"
            f"{f' in {style.packed} packed projections' if style.packed > 1 else ''}, not a multiple of "
            f"{size * style.packed}"
        )


def _split(module: nn.Module, mesh: DeviceMesh, style: Style, logits: bool = False, sequence: bool = False) -> None:
    """Split ``module``'s parameters as ``style`` says; ``logits``: the output layer, whose
    outputs stay split inside ``split_logits()``; ``sequence``: a column-wise layer's input
    comes split by position (all-gathered first), a row-wise linear layer's output goes so
    (a reduce-scatter in place of the all-reduce)."""
    placements = _placements(module, style)
    embedding = _layer_kind(module) == "embedding"

    def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            placed = distribute_tensor(param.data, mesh, [placements[pname]])
            mod.register_parameter(pname, nn.Parameter(placed, param.requires_grad))

    given = None
    if style.kind == "colwise":
        into, out = Replicate(), (Replicate() if style.gather else None)
        given = POSITIONS if sequence else None
    else:
        into, out = (
            (Replicate() if embedding else Shard(-1)),
            (POSITIONS if sequence and not embedding else Replicate()),
        )
    finish = logits_out(_outputs_as(out)) if logits else _outputs_as(out)
    distribute_module(module, mesh, partition, _inputs_as(into, given), finish)


def _inputs_as(placement: Placement, given: Placement | None = None) -> Callable[..., Any]:
    """A module's first input as a DTensor placed as ``placement``: a plain tensor is taken
    as placed ``given`` (default ``placement``), then redistributed."""

    def prepare(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        first = inputs[0]
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, [given or placement], run_check=False)
        elif first.placements != (placement,):
            first = first.redistribute(mesh, [placement])
        return (first, *inputs[1:])

    return prepare


def _outputs_as(placement: Placement | None) -> Callable[..., Any]:
    """A module's outputs as plain tensors (each DTensor's local part, placed as
    ``placement`` first where one is given)."""

    def finish(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        if isinstance(output, (tuple, list)):
            return type(output)(finish(module, x, mesh) for x in output)
        if not isinstance(output, DTensor):
            return output
        if placement is not None and output.placements != (placement,):
            output = output.redistribute(mesh, [placement])
        return output.to_local()

    return finish


def _replicated(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        whole = distribute_tensor(param.data, mesh, [Replicate()])
        module.register_parameter(pname, nn.Parameter(whole, param.requires_grad))


def _replicated_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_heads(module: nn.Module, name: str, size: int) -> None:
    found = [attr for attr in HEAD_ATTRIBUTES if isinstance(getattr(module, attr, None), int)]
    if not found:
        raise ConfigError(
            f"tensor-parallel plan: {name} has style heads, but none of {', '.join(HEAD_ATTRIBUTES)} to divide"
        )
    for attr in found:
        value = getattr(module, attr)
        if value % size:
            raise ConfigError(
                f"tensor parallelism over {size} processes: {name}.{attr} = {value}, not a multiple of {size}"
            )
        setattr(module, attr, value // size)


# ----- tied parameters -----------------------------------------------------------------------------
def _ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The modules (and attribute names) holding each parameter held by more than one."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, pname))
    return [found for found in holders.values() if len(found) > 1]


def _untie_conflicts(model: nn.Module, chosen: dict[str, Style], size: int) -> dict[str, Style]:
    """``chosen`` without the modules that would split a tied parameter otherwise than
    another module holding it does (it then stays whole in all of them)."""
    names = {id(module): name for name, module in model.named_modules()}
    kept = dict(chosen)
    for holders in _ties(model):
        placed = set()
        for module, pname in holders:
            style = chosen.get(names[id(module)])
            split = style is not None and style.kind in ("colwise", "rowwise")
            placed.add(_placements(module, style)[pname] if split else None)
        if len(placed) > 1:
            for module, _ in holders:
                kept.pop(names[id(module)], None)
    return kept
