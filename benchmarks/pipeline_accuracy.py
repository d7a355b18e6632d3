"""Accuracy of ``pipeline`` against ``single``, over several seeds.

For each model (on digits) and each seed, three runs with the same settings (model
initialisation, data order, learning rate and its schedule, epochs), each exactly as
``paratrain train`` runs it (``job.run`` in fresh processes started by ``paratrain.launch``):

- ``single``: one process;
- ``single-microbatched``: one process that cuts every batch into M equal micro-batches,
  adds their gradients (mean loss each) and divides by M: the arithmetic of the pipeline
  schedules without the pipeline (``MicrobatchedSingle`` below, a reference for this
  benchmark, not a paratrain mode);
- ``pipeline``: ``--strategy pipeline --stages S --microbatches M`` (S processes).

It reports each run's final test accuracy and test loss, and per model the mean and
the sample standard deviation over seeds of the accuracy and of pipeline - single; also
of pipeline - single in the mean accuracy of the last three epochs and in the test loss,
less noisy than the final accuracy, which swings by points from one epoch to the next.
Whether ``pipeline`` and ``single-microbatched`` end with the same test loss to the last
bit shows whether the pipeline computes exactly the micro-batched arithmetic; the
spread between seeds, and between ``single`` and ``single-microbatched`` (which differ
only in the order of floating-point sums), is the yardstick for the pipeline's gap.

    .venv/bin/python benchmarks/pipeline_accuracy.py [--models mlp,cifar_cnn] [--seeds 0,1,2]
        [--stages 2] [--microbatches 4] [--epochs E] [--out benchmarks/results/pipeline_accuracy.json]

Writes the JSON file and a Markdown table next to it (same name, ``.md``), and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's paratrain, also in the spawned processes

import torch  # noqa: E402

from paratrain.config import TrainConfig  # noqa: E402
from paratrain.launch.local import run_locally  # noqa: E402
from paratrain.registry import STRATEGIES  # noqa: E402
from paratrain.strategies.pipeline.config import PipelineConfig  # noqa: E402
from paratrain.strategies.single.strategy import SingleDeviceStrategy  # noqa: E402
from paratrain.strategies.step import StepOutput  # noqa: E402

#: Settings per model: the mlp at paratrain's defaults (15 epochs, lr 0.05, SGD momentum
#: 0.9, batch 32); cifar_cnn at the learning rate it trains with on digits.
MODELS = {"mlp": {}, "cifar_cnn": {"epochs": 10, "lr": 0.02}}
MODES = ("single", "single-microbatched", "pipeline")


class MicrobatchedSingle(SingleDeviceStrategy):
    """One process, gradients accumulated over ``num_microbatches`` equal micro-batches and
    divided by their number: what GPipe and 1F1B compute, in their order of sums."""

    name = "single-microbatched"
    options = PipelineConfig  # it takes --microbatches

    def __init__(self, num_microbatches: int = 4, device: str = "auto", timeout: float = 300.0):
        super().__init__(device=device, timeout=timeout)
        self.num_microbatches = num_microbatches

    @classmethod
    def from_config(cls, config: TrainConfig) -> MicrobatchedSingle:
        return cls(config.pipeline.microbatches, device=config.device, timeout=config.timeout)

    def train_step(self, model, loss_fn, optimizer, inputs, targets) -> StepOutput:
        optimizer.zero_grad(set_to_none=True)
        losses, logits = [], []
        for x, y in zip(inputs.chunk(self.num_microbatches), targets.chunk(self.num_microbatches)):
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()  # adds to .grad, micro-batch after micro-batch
            losses.append(loss.detach())
            logits.append(out.detach())
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(self.num_microbatches)
        optimizer.step()
        self._steps += 1
        return StepOutput(torch.stack(losses).mean(), torch.cat(logits))


# Registered in this process and in every spawned one (they import this file as a module).
STRATEGIES.register(MicrobatchedSingle.name, f"{__name__}:MicrobatchedSingle")


def train(mode: str, model: str, seed: int, stages: int, microbatches: int, epochs: int | None = None) -> dict:
    settings = {"model": model, "seed": seed, "device": "cpu", "progress": False, **MODELS[model]}
    if epochs is not None:
        settings["epochs"] = epochs
    if mode == "pipeline":
        settings.update(strategy="pipeline", stages=stages, microbatches=microbatches)
    elif mode == "single-microbatched":
        settings.update(strategy=mode, microbatches=microbatches)
    config = TrainConfig(**settings)
    metrics = run_locally(config)
    return {
        "mode": mode,
        "model": model,
        "seed": seed,
        "epochs": config.epochs,
        "lr": config.lr,
        "test_accuracy": metrics["test_accuracy"],
        "test_loss": metrics["test_loss"],
        "accuracy_by_epoch": [entry["test_accuracy"] for entry in metrics["history"]],
        "wall_seconds": metrics["wall_seconds"],
    }


def last3(run: dict) -> float:
    """Mean test accuracy of the last three epochs."""
    return statistics.mean(run["accuracy_by_epoch"][-3:])


def summary(runs: list[dict], model: str) -> dict:
    by = {mode: {r["seed"]: r for r in runs if r["model"] == model and r["mode"] == mode} for mode in MODES}
    seeds = sorted(by["single"])
    pipe, single = by["pipeline"], by["single"]

    def spread(values: list[float]) -> dict:
        return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}

    return {
        "model": model,
        "seeds": seeds,
        **{mode: spread([by[mode][s]["test_accuracy"] for s in seeds]) for mode in MODES},
        "pipeline_minus_single": spread([pipe[s]["test_accuracy"] - single[s]["test_accuracy"] for s in seeds]),
        # The final epoch's accuracy swings from epoch to epoch; two less noisy views of the same runs:
        "pipeline_minus_single_last3": spread([last3(pipe[s]) - last3(single[s]) for s in seeds]),
        "pipeline_minus_single_loss": spread([pipe[s]["test_loss"] - single[s]["test_loss"] for s in seeds]),
        "microbatched_minus_single": spread(
            [by["single-microbatched"][s]["test_accuracy"] - single[s]["test_accuracy"] for s in seeds]
        ),
        "pipeline_equals_microbatched": all(
            pipe[s]["test_loss"] == by["single-microbatched"][s]["test_loss"] for s in seeds
        ),
    }


def _points(fraction: float) -> str:
    value = 100 * fraction
    return f"{0.0 if abs(value) < 0.005 else value:.2f}"  # no "-0.00" for a difference of 1e-16


def table(runs: list[dict], summaries: list[dict], meta: dict) -> str:
    test_size = 364  # digits' test split
    lines = [
        f"Final test accuracy on digits ({test_size} test examples: one example is {100 / test_size:.2f} points), "
        f"`pipeline` with {meta['stages']} stages and {meta['microbatches']} micro-batches, 1F1B "
        f"(torch {meta['torch']}, {meta['cpus']} CPU cores). Re-run: `{meta['command']}`.",
        "",
        "| model | epochs, lr | seed | single | single, micro-batched | pipeline | pipeline - single "
        "| last 3 epochs: single, pipeline | test loss: single, pipeline | pipeline test loss = micro-batched |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    index = {(x["model"], x["seed"], x["mode"]): x for x in runs}
    for r in (r for r in runs if r["mode"] == "single"):
        pipe, micro = index[r["model"], r["seed"], "pipeline"], index[r["model"], r["seed"], "single-microbatched"]
        lines.append(
            f"| {r['model']} | {r['epochs']}, {r['lr']:g} | {r['seed']} | {r['test_accuracy']:.4f} "
            f"| {micro['test_accuracy']:.4f} | {pipe['test_accuracy']:.4f} "
            f"| {100 * (pipe['test_accuracy'] - r['test_accuracy']):+.2f} points "
            f"| {last3(r):.4f}, {last3(pipe):.4f} | {r['test_loss']:.4f}, {pipe['test_loss']:.4f} "
            f"| {'yes' if pipe['test_loss'] == micro['test_loss'] else 'no'} |"
        )
    lines += [
        "",
        "Mean ± sample standard deviation over the seeds (final accuracy in %, differences in points; "
        "last 3 epochs: the mean accuracy of the last three epochs):",
        "",
        "| model | seeds | single | single, micro-batched | pipeline | pipeline - single | micro-batched - single "
        "| pipeline - single, last 3 epochs | pipeline - single, test loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        cell = lambda d: f"{_points(d['mean'])} ± {100 * d['std']:.2f}"  # noqa: E731
        lines.append(
            f"| {s['model']} | {len(s['seeds'])} | {cell(s['single'])} | {cell(s['single-microbatched'])} "
            f"| {cell(s['pipeline'])} | {cell(s['pipeline_minus_single'])} | {cell(s['microbatched_minus_single'])} "
            f"| {cell(s['pipeline_minus_single_last3'])} "
            f"| {s['pipeline_minus_single_loss']['mean']:+.4f} ± {s['pipeline_minus_single_loss']['std']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cifar_cnn")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, help="for every model (default: 15 for mlp, 10 for cifar_cnn)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline_accuracy.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models, seeds = args.models.split(","), [int(s) for s in args.seeds.split(",")]
    runs = []
    for model in models:
        for seed in seeds:
            for mode in MODES:
                runs.append(train(mode, model, seed, args.stages, args.microbatches, args.epochs))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "accuracy_by_epoch"}), flush=True)
    summaries = [summary(runs, model) for model in models]
    meta = {
        "stages": args.stages,
        "microbatches": args.microbatches,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "command": "benchmarks/pipeline_accuracy.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summaries": summaries, "runs": runs}, indent=2) + "\n")
    text = table(runs, summaries, meta)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
