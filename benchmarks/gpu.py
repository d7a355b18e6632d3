"""paratrain on one GPU: what ``single`` costs over a plain PyTorch loop, and the training
throughput of the built-in gpt (tokens/s) and the CIFAR-10 CNN (examples/s) per strategy.

    python benchmarks/gpu.py --parts overhead,throughput --out DIR [--quick]

- ``overhead``: the same model, optimizer and batches from the same initial weights, one
  side a hand-written loop (a random permutation of the data set on the GPU sliced into
  batches: forward, cross-entropy, backward, step), the other ``Trainer.fit`` under
  ``single``. One untimed round each, then ``--rounds`` rounds of three epochs alternating
  the sides (the order flips every round). Steady state: each epoch timed between drained
  GPUs (a loop reads its epoch's loss at the end); the overhead is the median over rounds
  of paratrain's epochs over the plain loop's. Target: <= 3%. Per round: each side's
  whole round, which for paratrain is a ``fit`` call (its set-up and the data set's move to
  the GPU) and for the plain loop moves its data set to the GPU too. ``--profile`` adds
  CUDA kernels, launches and the GPU's busy time per step of each side (torch.profiler)
  and writes both sides' host profiles to DIR/profile-MODEL.txt.
- ``throughput``: whole ``paratrain train`` runs (``run_locally``, as the command starts
  them), each strategy at its settings below on the one GPU (processes beyond the first
  share it over Gloo); the metrics file's training throughput (evaluation and start-up
  excluded).

The CNN trains on random images of CIFAR-10's shape (``images`` below: the throughput of
a conv net does not depend on what the pixels show, and the machine has no copy of the
data set). Writes DIR/gpu.json and DIR/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from recorded_table import cpu_name  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import paratrain  # noqa: E402
from paratrain.config import TrainConfig  # noqa: E402
from paratrain.data.datasets import load_dataset  # noqa: E402
from paratrain.launch.local import run_locally  # noqa: E402
from paratrain.models import build_model  # noqa: E402

GPT = {"model": "gpt", "dataset": "text-lm", "seq_len": 128, "gpt_layers": 4, "gpt_width": 256, "gpt_heads": 4}
CNN = {"model": "cifar_cnn", "dataset": "benchmarks.gpu:images"}
STRATEGIES = {
    "single": {},
    "allreduce x1": {"strategy": "allreduce", "workers": 1},
    "allreduce x2 (shared GPU)": {"strategy": "allreduce", "workers": 2},
    "fsdp x1": {"strategy": "fsdp", "workers": 1},
    "ps-sync x2": {"strategy": "ps-sync", "workers": 2},
    "ps-async x2": {"strategy": "ps-async", "workers": 2},
    "local-sgd x2": {"strategy": "local-sgd", "workers": 2},
    "pipeline 2 stages": {"strategy": "pipeline", "stages": 2, "microbatches": 4},
}


def images(config: Any = None, examples: int = 20_000) -> tuple[TensorDataset, TensorDataset]:
    """Random 3x32x32 images, each labelled by the sign pattern of three fixed pixel sums (a
    rule a conv net can learn), 10 classes as CIFAR-10 has; a tenth of them to test."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(examples, 3, 32, 32, generator=generator)
    labels = (x[:, 0, :16].sum((1, 2)) > 0).long() * 4 + (x[:, 1, 16:].sum((1, 2)) > 0).long() * 2
    labels += (x[:, 2].mean((1, 2)) > 0).long()
    labels = labels % 10
    cut = examples * 9 // 10
    return TensorDataset(x[:cut], labels[:cut]), TensorDataset(x[cut:], labels[cut:])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _plain_epoch(model, optimizer, x, y, batch, device, generator) -> None:
    order = torch.randperm(len(x), generator=generator).to(device)
    for start in range(0, len(x) - batch + 1, batch):
        index = order[start : start + batch]
        inputs, targets = x[index], y[index]
        optimizer.zero_grad(set_to_none=True)
        outputs = model(inputs)
        loss = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()


class _EpochClock(paratrain.Callback):
    """Each epoch's time in a ``fit``, the GPU drained at both ends (the loop reads the
    epoch's losses at its end, which waits for the GPU anyway)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self._start)


def _profile_side(run: Any, steps: int, report: list[str], side: str) -> dict[str, float]:
    """CUDA kernels launched, the GPU's busy time and the host's per step over one round of
    ``run`` (torch.profiler), and a host profile (cProfile) of another round; the tables go
    to ``report``. The two sides should launch the same kernels; where the GPU is busy for
    less than a step, the step waits on the host, and the host profiles say for what."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        began = time.perf_counter()
        run()
        seconds = time.perf_counter() - began
    events = trace.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sum(e.count for e in events if e.device_type == cuda)
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == cuda)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    report += [
        f"## {side}: {steps} steps, {1000 * seconds / steps:.3f} ms/step profiled, GPU busy "
        f"{busy_us / 1000 / steps:.3f} ms/step, {kernels / steps:.1f} kernels/step",
        "",
    ]
    report.append(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    report.append(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    profiler, text = cProfile.Profile(), io.StringIO()
    profiler.runcall(run)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    report += [text.getvalue(), ""]
    return {
        "kernels_per_step": kernels / steps,
        "launches_per_step": launches / steps,
        "gpu_busy_ms_per_step": busy_us / 1000 / steps,
    }


def overhead(
    name: str,
    settings: dict[str, Any],
    batch: int,
    rounds: int,
    examples: int,
    device: torch.device,
    per_round: int = 3,
    profile: bool = False,
) -> dict[str, Any]:
    """paratrain single's time per step over the plain loop's, in steady state (epochs
    inside a round, each bracketed by a drained GPU) and per round (a ``fit`` call, its
    fixed costs counted: the data set's move to the GPU, set-up, each epoch's loss
    reduction; the plain loop moves its data set in its round too)."""
    config = TrainConfig(**settings, batch_size=batch)
    splits = load_dataset(config)
    x, y = splits.train[: min(examples, len(splits.train))]
    torch.manual_seed(0)
    template = build_model(config.model, splits.spec, options=config.model_options)

    def fresh():
        model = build_model(config.model, splits.spec, options=config.model_options)
        model.load_state_dict(template.state_dict())
        return model

    plain_model = fresh().to(device)
    plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    model = fresh()
    clock = _EpochClock(device)
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        metrics=(),
        strategy=paratrain.SingleDeviceStrategy(device=device.type),
    )
    generator = torch.Generator().manual_seed(0)
    plain_epochs: list[float] = []

    def plain() -> float:
        synchronize(device)
        start = time.perf_counter()
        x_there, y_there = x.to(device), y.to(device)
        for _ in range(per_round):
            began = time.perf_counter()
            _plain_epoch(plain_model, plain_optimizer, x_there, y_there, batch, device, generator)
            synchronize(device)
            plain_epochs.append(time.perf_counter() - began)
        return time.perf_counter() - start

    data, epochs = TensorDataset(x, y), [0]

    def ours() -> float:
        epochs[0] += per_round  # fit(epochs=N) trains on up to epoch N, as Keras's does
        synchronize(device)
        start = time.perf_counter()
        trainer.fit(data, epochs=epochs[0], batch_size=batch, verbose=0, log_every=0, callbacks=[clock])
        synchronize(device)
        return time.perf_counter() - start

    plain(), ours()  # warm-up: kernels chosen, memory pools grown
    del plain_epochs[:], clock.seconds[:]
    ratios = []
    steady = []
    times = {"plain": [], "paratrain": []}
    for r in range(rounds):
        pair = (("plain", plain), ("paratrain", ours)) if r % 2 == 0 else (("paratrain", ours), ("plain", plain))
        result = {side: fn() for side, fn in pair}
        for side, seconds in result.items():
            times[side].append(seconds)
        ratios.append(result["paratrain"] / result["plain"])
        steady.append(sum(clock.seconds[-per_round:]) / sum(plain_epochs[-per_round:]))
    steps_per_epoch = len(x) // batch
    steps = steps_per_epoch * per_round
    row = {
        "model": name,
        "batch": batch,
        "steps_per_round": steps,
        "plain_step_ms": 1000 * statistics.median(plain_epochs) / steps_per_epoch,
        "paratrain_step_ms": 1000 * statistics.median(clock.seconds) / steps_per_epoch,
        "overhead": statistics.median(steady) - 1.0,
        "steady_ratios": steady,
        "plain_round_ms": 1000 * statistics.median(times["plain"]),
        "paratrain_round_ms": 1000 * statistics.median(times["paratrain"]),
        "round_overhead": statistics.median(ratios) - 1.0,
        "ratios": ratios,
    }
    if profile:  # where each side spends its time: kernels, the GPU's busy time, host profiles
        report: list[str] = [f"# {name}, batch {batch}", ""]
        row["plain_profile"] = _profile_side(plain, steps, report, "plain")
        row["paratrain_profile"] = _profile_side(ours, steps, report, "paratrain")
        row["profile_report"] = "\n".join(report)
    return row


def throughput(
    name: str, settings: dict[str, Any], batch: int, epochs: int, device: str, log: Any
) -> list[dict[str, Any]]:
    rows = []
    for label, strategy in STRATEGIES.items():
        row: dict[str, Any] = {"model": name, "strategy": label, "batch_per_replica": batch}
        try:
            config = TrainConfig(
                **settings,
                **strategy,
                batch_size=batch,
                epochs=epochs,
                optimizer="adamw",
                lr=1e-3,
                device=device,
                progress=False,
                log_every=0,
            )
            metrics = run_locally(config)
            row.update(
                examples_per_second=metrics["examples_per_second"],
                tokens_per_second=metrics.get("tokens_per_second"),
                test_loss=metrics["test_loss"],
                global_batch=config.global_batch,
            )
        except Exception as error:  # one strategy's failure is a row, not the end of the benchmark
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        log(json.dumps(row))
    return rows


def _table(title: str, header: str, rows: list[str]) -> list[str]:
    columns = header.count("|") - 1
    return [f"## {title}", "", header, "|" + "---|" * columns, *rows, ""]


def _overhead_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['model']} | | | | {r['error']} | | | |"
    return (
        f"| {r['model']} | {r['batch']} | {r['plain_step_ms']:.2f} | {r['paratrain_step_ms']:.2f} | "
        f"{100 * r['overhead']:+.1f}% | {r['plain_round_ms']:.0f} | {r['paratrain_round_ms']:.0f} | "
        f"{100 * r['round_overhead']:+.1f}% |"
    )


def _throughput_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['model']} | {r['strategy']} | | {r['error']} | |"
    tokens = f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") else ""
    return f"| {r['model']} | {r['strategy']} | {r['global_batch']} | {r['examples_per_second']:.0f} | {tokens} |"


def markdown(document: dict[str, Any]) -> str:
    lines = [f"# paratrain on one GPU ({document['settings']['device_name']})", ""]
    if document.get("overhead"):
        header = (
            "| model | batch | plain ms/step | paratrain ms/step | overhead (steady) "
            "| plain ms/round | paratrain ms/round | overhead (round) |"
        )
        lines += _table("single against a plain PyTorch loop", header, [_overhead_row(r) for r in document["overhead"]])
    if document.get("throughput"):
        header = "| model | strategy | global batch | examples/s | tokens/s |"
        lines += _table("Throughput per strategy", header, [_throughput_row(r) for r in document["throughput"]])
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="overhead,throughput")
    parser.add_argument("--models", default="gpt,cifar_cnn", help="the overhead part's models")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--profile", action="store_true", help="profile both sides of each model (DIR/profile-MODEL.txt)"
    )
    parser.add_argument("--quick", action="store_true", help="small models and data (a smoke run, on the CPU too)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    log = lambda line: print(line, flush=True)  # noqa: E731
    gpt, cnn = dict(GPT), dict(CNN)
    examples = 6_400
    if args.quick:
        gpt.update(seq_len=32, gpt_layers=1, gpt_width=32, gpt_heads=2)
        examples = 640
    document: dict[str, Any] = {
        "settings": {
            **vars(args),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else cpu_name(),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "gpt": gpt,
        }
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each model: a step's time limit loses only the part in flight
        for row in document.get("overhead", []):  # --profile's tables, a file per model
            if "profile_report" in row:
                (out / f"profile-{row['model']}.txt").write_text(row.pop("profile_report"))
        (out / "gpu.json").write_text(json.dumps(document, indent=1) + "\n")
        (out / "gpu.md").write_text(markdown(document))

    parts = args.parts.split(",")
    if "overhead" in parts:
        document["overhead"] = []
        for name, settings, batch in (("gpt", gpt, 32), ("cifar_cnn", cnn, 128)):
            if name not in args.models.split(","):
                continue
            try:
                row = overhead(
                    name, settings, batch, args.rounds, examples, torch.device(args.device), profile=args.profile
                )
            except Exception as error:
                traceback.print_exc()
                row = {"model": name, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            document["overhead"].append(row)
            save()
            log(json.dumps(row))
    if "throughput" in parts:
        document["throughput"] = throughput("gpt", gpt, 32, args.epochs, args.device, log)
        save()
        document["throughput"] += throughput("cifar_cnn", cnn, 128, args.epochs, args.device, log)
        save()
    print(markdown(document))


if __name__ == "__main__":
    main()
