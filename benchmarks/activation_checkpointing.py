"""What activation checkpointing saves and costs: the built-in gpt, one batch, for each of
``--activation-checkpointing none, every-2, blocks``.

    python benchmarks/activation_checkpointing.py [--layers 8 --width 256 --seq-len 256 --batch 16] [--device cpu]

Per setting: the bytes autograd keeps for the backward pass (``saved_activation_bytes``:
parameters not counted, each storage once; on a GPU also the peak memory allocated during
the step), and the median step time (forward, backward, AdamW) over ``--steps`` steps after
two untimed ones. Writes benchmarks/results/activation_checkpointing.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from paratrain.models.gpt import GPT  # noqa: E402
from paratrain.models.gpt_config import GPTConfig  # noqa: E402
from paratrain.strategies.activation import saved_activation_bytes  # noqa: E402
from paratrain.strategies.recipe import StepRecipe  # noqa: E402
from paratrain.train.scores import cross_entropy_loss  # noqa: E402

SETTINGS = ("none", "every-2", "blocks")


def measure(how: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    sizes = GPTConfig(gpt_layers=args.layers, gpt_width=args.width, gpt_heads=args.heads)
    model = StepRecipe(activation_checkpointing=how).prepare_model(GPT(256, args.seq_len, sizes)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (args.batch, args.seq_len), device=device)
    targets = torch.randint(0, 256, (args.batch, args.seq_len), device=device)
    kept = saved_activation_bytes(lambda: cross_entropy_loss(model(ids), targets), model)

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        cross_entropy_loss(model(ids), targets).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step(), step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.steps)]
    row = {"setting": how, "saved_activation_mb": kept / 1e6, "step_ms": 1000 * statistics.median(times)}
    if device.type == "cuda":
        row["peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/activation_checkpointing.json")
    args = parser.parse_args()
    rows = [measure(how, args) for how in SETTINGS]
    for row in rows:
        row["saved_vs_none"] = row["saved_activation_mb"] / rows[0]["saved_activation_mb"]
        row["time_vs_none"] = row["step_ms"] / rows[0]["step_ms"]
        print(json.dumps(row), flush=True)
    settings = {**vars(args), "torch": torch.__version__, "python": platform.python_version()}
    out = Path(args.out)
    out.write_text(json.dumps({"rows": rows, "settings": settings}, indent=1) + "\n")
    lines = [
        f"# Activation checkpointing: gpt, {args.layers} layers, width {args.width}, {args.seq_len} tokens, "
        f"batch {args.batch}, {args.device}",
        "",
        "| setting | activations kept (MB) | vs none | step ms | vs none |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['setting']} | {r['saved_activation_mb']:.1f} | {r['saved_vs_none']:.2f}x | {r['step_ms']:.0f} | "
        f"{r['time_vs_none']:.2f}x |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
