"""Memory per process: fsdp against allreduce, on a model large enough to show it.

    .venv/bin/python benchmarks/fsdp_memory.py [--width 2048] [--layers 6] [--workers 2,4]

Each setting trains an MLP of ``--layers`` square Linear layers of ``--width`` (25M
parameters, 101 MB in fp32 by default) with Adam for ``--steps`` steps on random
batches, through ``paratrain.launch`` as ``paratrain train --strategy S --workers N``
does. Every process reports:

- ``training_mb``: the peak resident memory while training (Linux's VmHWM, its high-water
  mark reset through /proc/self/clear_refs once the model is prepared), less the
  resident memory before the model was built: what training holds on top of the
  interpreter, PyTorch and the process group (with a fixed ``MALLOC_MMAP_THRESHOLD_``, so
  that freed tensors leave the resident set);
- ``state_mb``: what the process holds of the parameters, gradients and Adam's two
  moments after training (the tensors' own bytes: for fsdp, its shards).

The aim (issue: memory per process near 1/N of allreduce's for the parameter and optimizer
share) is read from ``state_mb``; ``training_mb`` adds what both modes also hold while
computing (activations, fsdp's gathered layers, DDP's buckets, allocator slack).

Writes benchmarks/results/fsdp_memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(strategy_name: str, width: int, layers: int, steps: int, batch: int) -> dict:
    import gc

    import torch
    from torch import nn

    import paratrain

    strategy = paratrain.make_strategy(strategy_name, device="cpu")
    strategy.setup()
    gc.collect()
    before_kb = _status_kb("VmRSS")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = strategy.prepare(model, optimizer)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    for _ in range(steps):
        strategy.train_step(model, nn.functional.mse_loss, optimizer, x, y)
    peak_kb = _status_kb("VmHWM")

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    moments = [local(v) for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    state = sum(t.numel() * t.element_size() for t in params + grads + moments)
    result = {
        "rank": strategy.process_rank,
        "training_mb": (peak_kb - before_kb) / 1024,
        "state_mb": state / MB,
        "parameters": sum(p.numel() for p in params),
    }
    strategy.teardown()
    return result


def markdown(document: dict) -> str:
    lines = [
        f"Memory per process: an MLP of {document['layers']} Linear layers of {document['width']} "
        f"({document['parameters'] / 1e6:.1f}M parameters, {document['parameters'] * 4 / MB:.0f} MB in fp32), "
        f"Adam, batch {document['batch']}, {document['steps']} steps, CPU, Gloo. state: parameters + gradients + "
        "Adam's moments held by each process (the mean over processes); training: peak resident memory while "
        "training, above the process before the model was built (the largest process).",
        "",
        "| strategy | workers | state MB per process | vs allreduce | training MB per process | vs allreduce |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = document["rows"]
    for row in rows:
        base = next(r for r in rows if r["workers"] == row["workers"] and r["strategy"] == "allreduce")
        lines.append(
            f"| {row['strategy']} | {row['workers']} | {row['state_mb']:.0f} | {row['state_mb'] / base['state_mb']:.2f}x "
            f"| {row['training_mb']:.0f} | {row['training_mb'] / base['training_mb']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fsdp_memory.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Tensors from 128 KiB up go to their own mappings, returned to the system when freed:
    # glibc otherwise raises that threshold after the first large frees (the unsharded model
    # fsdp replaces) and keeps freed memory resident, which RSS would count as training's.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    import torch

    from paratrain.testing import run_distributed

    rows = []
    for workers in map(int, args.workers.split(",")):
        for strategy in ("allreduce", "fsdp"):
            ranks = run_distributed(
                measure, strategy, args.width, args.layers, args.steps, args.batch, world_size=workers
            )
            row = {
                "strategy": strategy,
                "workers": workers,
                "state_mb": sum(r["state_mb"] for r in ranks) / len(ranks),
                "training_mb": max(r["training_mb"] for r in ranks),
                "ranks": ranks,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    document = {
        "command": " ".join(["python", "benchmarks/fsdp_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "width": args.width,
        "layers": args.layers,
        "steps": args.steps,
        "batch": args.batch,
        "parameters": args.layers * (args.width * args.width + args.width),
        "rows": rows,
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()},
    }
    out = Path(args.out)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
