"""What keeping freed host memory (``--keep-host-memory``, launch/allocator.py) saves a CPU
step: its minor page faults and its time, on models whose step allocates blocks above
glibc's largest mmap threshold (32 MiB), and one whose blocks stay below it.

    python benchmarks/host_memory.py [--rounds 3] [--steps 20]

Three settings of the process's malloc, each in a process of its own (the setting is the
process's), one ``single`` step at a time with the Trainer's defaults otherwise, all the
process's cores:

- ``malloc as it is``: ``keep_host_memory=False``;
- ``thresholds only``: the mmap threshold at its 32 MiB maximum and the heap's top never
  given back (what ``--keep-host-memory`` set before it stopped mapping large blocks apart);
- ``kept``: ``--keep-host-memory`` as it is now (no block mapped apart).

The models: the tutorials' LSTM text classifier (200 token ids of 20,000, embedding 64,
LSTM 128; batch 64: its step allocates one 95 MB block), the plain
conv net of tensorflow_mirrored.py at batch 256 (two replicas' batch in one process: a
38 MB activation) and the tutorial CNN at batch 128 (every block below 32 MiB). Each
process trains ``--warmup`` steps, then ``--steps`` timed ones on one fixed random batch;
its median step time and its minor page faults a step are recorded. Rounds run the
settings in turn, the order reversed every other round (a shared machine drifts); the
tables give the medians over rounds. What a page fault costs differs between machines and
between days of one virtual machine: the fault counts are the machine-independent part.

Writes benchmarks/results/host_memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record  # noqa: E402

MODES = ("malloc as it is", "thresholds only", "kept")
#: model -> (batch, what it is)
MODELS = {
    "lstm": (64, "LSTM text classifier, 200 tokens"),
    "plain_cnn": (256, "plain conv net, 24x24"),
    "cifar_cnn": (128, "tutorial CNN, 24x24"),
}


def build(name: str, batch: int):
    """The model and one fixed batch (inputs, targets)."""
    import torch

    from paratrain.data.spec import DataSpec
    from paratrain.models import build_model

    generator = torch.Generator().manual_seed(1)
    if name == "lstm":
        spec = DataSpec(input_shape=(200,), num_classes=2, input_kind="tokens", vocab_size=20000)
        inputs = torch.randint(1, 20000, (batch, 200), generator=generator)
    else:
        spec = DataSpec(input_shape=(3, 24, 24), num_classes=10)
        inputs = torch.randn(batch, 3, 24, 24, generator=generator)
    torch.manual_seed(0)
    if name == "plain_cnn":
        from tensorflow_mirrored import plain_cnn

        model = plain_cnn()
    else:
        model = build_model(name, spec)
    return model, inputs, torch.randint(0, spec.num_classes, (batch,), generator=generator)


def thresholds_only() -> None:
    """The mmap threshold at glibc's 32 MiB maximum and no trimming; blocks above it mapped."""
    from paratrain.launch import allocator

    assert allocator.set_malloc(allocator.KEPT[:2])


def measure(name: str, mode: str, args: argparse.Namespace) -> dict:
    """In this process: ``mode``'s median step time (ms) and minor page faults a step."""
    import torch

    import paratrain

    if mode == "thresholds only":
        thresholds_only()
    batch, _ = MODELS[name]
    model, inputs, targets = build(name, batch)
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
        keep_host_memory=mode == "kept",
    )
    step = trainer.strategy.train_step
    for _ in range(args.warmup):
        step(trainer.model, trainer.loss_fn, trainer.optimizer, inputs, targets)
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.steps):
        start = time.perf_counter()
        step(trainer.model, trainer.loss_fn, trainer.optimizer, inputs, targets)
        times.append(time.perf_counter() - start)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    return {"ms": 1000 * statistics.median(times), "faults": faults, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=str(RESULTS / "host_memory"))
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args)))
        return
    models = args.models.split(",")
    runs: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in models}
    for index in range(args.rounds):
        for name in models:
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                command = [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--one",
                    name,
                    mode,
                ]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[name][mode].append(json.loads(done.stdout.splitlines()[-1]))
                print(f"round {index + 1}: {name} {mode}: {runs[name][mode][-1]}", flush=True)
    rows = []
    for name in models:
        row = {"model": name, "batch": MODELS[name][0], "threads": runs[name]["kept"][0]["threads"]}
        for mode in MODES:
            row[mode] = {key: statistics.median(run[key] for run in runs[name][mode]) for key in ("ms", "faults")}
        rows.append(row)
    import torch

    document = {
        "setup": {
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "glibc": platform.libc_ver()[1],
        },
        "rows": rows,
    }
    lines = [
        "# Host memory kept: a CPU step's page faults and time by malloc setting",
        "",
        f"`python benchmarks/host_memory.py --rounds {args.rounds} --steps {args.steps}`: `single`, the Trainer's "
        f"defaults, torch {torch.__version__}, glibc {platform.libc_ver()[1]}; each setting in a process of its own; "
        f"medians over {args.rounds} rounds (each a median of {args.steps} steps after {args.warmup}).",
        "",
        "| model | batch | threads | "
        + " | ".join(f"{mode}: ms" for mode in MODES)
        + " | "
        + " | ".join(f"{mode}: faults a step" for mode in MODES)
        + " | kept / as it is |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in range(2 * len(MODES))) + " | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {MODELS[row['model']][1]} | {row['batch']} | {row['threads']} | "
            + " | ".join(f"{row[mode]['ms']:.1f}" for mode in MODES)
            + " | "
            + " | ".join(f"{row[mode]['faults']:,.0f}" for mode in MODES)
            + f" | {row['kept']['ms'] / row['malloc as it is']['ms']:.2f}x |"
        )
    record(Path(args.out), document, lines)


if __name__ == "__main__":
    main()
