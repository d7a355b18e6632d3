"""Gradient compression where bandwidth is scarce: allreduce on 4 emulated hosts whose
links are shaped to 100 Mbit/s and 1 Gbit/s (tc tbf; netem is not available, so the
only latency is queueing), for every codec.

Each host has a fixed CPU share. For each link, model and codec, one run of `paratrain
cluster run` records the time per epoch, the time to a test accuracy and the final
accuracy (benchmarks/cluster_common.py says from when they count). The tutorial CNN runs
on digits at CIFAR's shape (cluster_common.digits32: 1.7M parameters, 6.8 MB a step
uncompressed); the LSTM classifier on digits.

    sudo .venv/bin/python benchmarks/cluster_bandwidth.py [--links 100mbit,1gbit] [--codecs none,fp16,int8,topk,powersgd]

Writes benchmarks/results/cluster_bandwidth.json and .md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cluster_common import RESULTS, cluster_train, record, seconds_to, shown

# model -> (data set, training settings, target test accuracy)
MODELS = {
    "cifar_cnn": ("benchmarks.cluster_common:digits32", ["--optimizer", "adam", "--lr", "0.001"], 0.9),
    "lstm": ("digits", ["--optimizer", "adam", "--lr", "0.01"], 0.8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="100mbit,1gbit")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--codecs", default="none,fp16,int8,topk,powersgd")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--cpu", type=float, default=0.45, help="each host's share of a core")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS / "cluster_bandwidth"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in args.links.split(","):
            for model in args.models.split(","):
                dataset, settings, target = MODELS[model]
                for codec in args.codecs.split(","):
                    cluster = ["--hosts", str(args.hosts), "--cpu", f"{args.cpu:g}", "--link", link]
                    train = [
                        "--strategy",
                        "allreduce",
                        "--workers",
                        str(args.hosts),
                        "--model",
                        model,
                        "--dataset",
                        dataset,
                        *settings,
                        "--compression",
                        codec,
                        "--epochs",
                        str(args.epochs),
                    ]
                    metrics = cluster_train(cluster, train, Path(tmp) / "m.json")
                    row = {
                        "link": link,
                        "model": model,
                        "codec": codec,
                        "epoch_seconds": metrics["epoch_seconds"],
                        "bytes_per_step": metrics["bytes_per_step"],
                        "target": target,
                        "seconds_to_target": seconds_to(metrics, target),
                        "test_accuracy": metrics["test_accuracy"],
                    }
                    rows.append(row)
                    print(
                        f"{link:7} {model:9} {codec:8} {row['epoch_seconds']:6.2f} s/epoch "
                        f"{shown(row['seconds_to_target'])} s to {target:g}, accuracy {row['test_accuracy']:.3f}",
                        flush=True,
                    )
    lines = [
        f"# Compression on shaped links: allreduce on {args.hosts} emulated hosts",
        "",
        f"Each host {args.cpu:g} of a core; {args.epochs} epochs, batch 32 per worker "
        "(`sudo python benchmarks/cluster_bandwidth.py`). Times count from the end of epoch 1 (every host has "
        "started); seconds to target is to the end of the first epoch at that test accuracy.",
        "",
        "| link | model | codec | bytes/step | s/epoch | vs none | seconds to target | test accuracy |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        base = next(b for b in rows if (b["link"], b["model"], b["codec"]) == (r["link"], r["model"], rows[0]["codec"]))
        lines.append(
            f"| {r['link']} | {r['model']} | {r['codec']} | {r['bytes_per_step']:,.0f} | {r['epoch_seconds']:.2f} "
            f"| {base['epoch_seconds'] / r['epoch_seconds']:.2f}x | {shown(r['seconds_to_target'])} (to {r['target']:g}) "
            f"| {r['test_accuracy']:.3f} |"
        )
    record(Path(args.out), {"setup": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, lines)


if __name__ == "__main__":
    main()
