"""What ``--onednn-layers`` (paratrain/strategies/cpu_layers.py) changes, on one core.

    python benchmarks/cpu_layers.py [--rounds 5] [--out DIR]

1. Matrix products of float32 linear layers through MKL (``torch.nn.functional.linear``,
   PyTorch's default) and through oneDNN (``mkldnn::_linear_pointwise``): GFLOP/s, the
   median of 20 calls, for the forward product and both backward ones of the plain conv
   net's first fully connected layer (batch 128, 2304 -> 384), the mlp's hidden layer
   (128, 784 -> 256) and a GPT-2 small projection (8 x 128 tokens, 768 -> 2304).
2. A convolution's weight gradient with its bias gradient in oneDNN's one pass, and
   without it followed by the sum of the output gradient (the plain conv net's two
   convolutions, batch 128, channels-last): milliseconds, the median of 10.
3. Training steps of paratrain ``single`` in one process of one thread, ``onednn_layers``
   off and on by default, alternating, ``--rounds`` rounds: the median examples/s of each
   round's steady epochs, for the plain conv net (benchmarks/tensorflow_mirrored.py's),
   the tutorial CNN and the mlp (paratrain's own).

Writes DIR/cpu_layers.json and .md (default benchmarks/results), the processor named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from recorded_table import cpu_name  # noqa: E402
from torch.nn import functional  # noqa: E402

LINEARS = {  # name: (rows, in, out)
    "plain_cnn fc 2304->384": (128, 2304, 384),
    "mlp hidden 784->256": (128, 784, 256),
    "gpt2 c_attn 768->2304": (1024, 768, 2304),
}
CONVS = {"plain_cnn conv1 3->64 24x24": (3, 24), "plain_cnn conv2 64->64 12x12": (64, 12)}
MODELS = ("plain_cnn", "cifar_cnn", "mlp")
SHAPES = {"plain_cnn": (3, 24, 24), "cifar_cnn": (3, 24, 24), "mlp": (1, 28, 28)}


def benchmark_model(name: str) -> tuple[object, tuple[int, ...]]:
    """``name``'s model (the plain conv net, or a built-in one for 10 classes) and its input shape."""
    shape = SHAPES.get(name, (3, 24, 24))
    if name == "plain_cnn":
        from tensorflow_mirrored import plain_cnn

        return plain_cnn(), shape
    from paratrain.data.datasets import DataSpec
    from paratrain.models import build_model

    return build_model(name, DataSpec(shape, 10)), shape


def median_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_rates() -> list[dict]:
    onednn = torch.ops.mkldnn._linear_pointwise
    rows = []
    for name, (m, k, n) in LINEARS.items():
        x = torch.randn(m, k)
        w = torch.randn(n, k)
        dy = torch.randn(m, n)
        products = {  # (MKL, oneDNN) for each product of a step
            "forward": (lambda: functional.linear(x, w), lambda: onednn(x, w, None, "none", [], "")),
            "input gradient": (lambda: dy @ w, lambda: onednn(dy, w.t(), None, "none", [], "")),
            "weight gradient": (lambda: dy.t() @ x, lambda: onednn(dy.t(), x.t(), None, "none", [], "")),
        }
        flops = 2 * m * k * n
        for product, (mkl, dnn) in products.items():
            rates = [flops / median_seconds(call, 20) / 1e9 for call in (mkl, dnn)]
            rows.append({"layer": name, "product": product, "mkl": rates[0], "onednn": rates[1]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def conv_times() -> list[dict]:
    rows = []
    for name, (channels, size) in CONVS.items():
        x = torch.randn(128, channels, size, size).to(memory_format=torch.channels_last)
        w = torch.randn(64, channels, 5, 5)
        dy = torch.randn(128, 64, size, size).to(memory_format=torch.channels_last)
        grads = [channels > 3, True]  # the first convolution's input needs no gradient

        def together():
            torch.ops.aten.convolution_backward(
                dy, x, w, [64], [1, 1], [2, 2], [1, 1], False, [0, 0], 1, [*grads, True]
            )

        def apart():
            torch.ops.aten.convolution_backward(
                dy, x, w, None, [1, 1], [2, 2], [1, 1], False, [0, 0], 1, [*grads, False]
            )
            dy.sum((0, 2, 3))

        ms = [median_seconds(call, 10) * 1e3 for call in (together, apart)]
        rows.append({"convolution": name, "backward_with_bias_ms": ms[0], "apart_ms": ms[1]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def train_rate(model_name: str, onednn_layers: bool | None) -> float:
    import paratrain

    torch.manual_seed(0)
    model, shape = benchmark_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    strategy = paratrain.SingleDeviceStrategy("cpu")
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        optimizer,
        strategy=strategy,
        cpu=paratrain.CpuTuning(onednn_layers=onednn_layers, threads=1),
    )
    x, y = torch.randn(128 * 25, *shape), torch.randint(0, 10, (128 * 25,))
    history = trainer.fit((x, y), epochs=4, batch_size=128, verbose=0, log_every=0)
    return statistics.median(e["examples_per_second"] for e in history.epochs[1:])


def train_rates(rounds: int) -> list[dict]:
    rows = []
    for model_name in MODELS:
        samples: dict[str, list[float]] = {"off": [], "on": []}
        for index in range(rounds):
            order = ("off", "on") if index % 2 == 0 else ("on", "off")
            for side in order:
                samples[side].append(train_rate(model_name, False if side == "off" else None))
        off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
        rows.append({"model": model_name, "off": off, "on": on, "ratio": on / off, "samples": samples})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(document: dict) -> str:
    lines = [
        f"# `--onednn-layers` on one core ({document['processor']}, {document['vendor']}; torch {document['torch']})",
        "",
        "Matrix products of linear layers, GFLOP/s (median of 20 calls):",
        "",
        "| layer | product | MKL | oneDNN | oneDNN / MKL |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row in document["linear"]:
        lines.append(
            f"| {row['layer']} | {row['product']} | {row['mkl']:.0f} | {row['onednn']:.0f} | "
            f"{row['onednn'] / row['mkl']:.2f}x |"
        )
    lines += [
        "",
        "A convolution's weight and bias gradients (batch 128, channels-last), ms (median of 10):",
        "",
        "| convolution | one pass with the bias | weight alone + sum | apart / with |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in document["conv"]:
        lines.append(
            f"| {row['convolution']} | {row['backward_with_bias_ms']:.2f} | {row['apart_ms']:.2f} | "
            f"{row['apart_ms'] / row['backward_with_bias_ms']:.2f}x |"
        )
    lines += [
        "",
        f"Training, paratrain `single`, one thread, batch 128, examples/s (median of {document['rounds']} "
        "alternating rounds, each the median of epochs 2-4):",
        "",
        "| model | `--no-onednn-layers` | default | default / off |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in document["train"]:
        lines.append(f"| {row['model']} | {row['off']:,.0f} | {row['on']:,.0f} | {row['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    from paratrain.launch.allocator import keep_freed_memory
    from paratrain.strategies.cpu_layers import cpu_vendor

    torch.set_num_threads(1)
    keep_freed_memory()  # as the Trainer does, for the products and gradients too
    document = {
        "command": " ".join(["python", "benchmarks/cpu_layers.py", *sys.argv[1:]]),
        "processor": cpu_name(),
        "vendor": cpu_vendor(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "linear": linear_rates(),
        "conv": conv_times(),
        "train": train_rates(args.rounds),
    }
    out = Path(args.out)
    (out / "cpu_layers.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / "cpu_layers.md").write_text(markdown(document))
    print(markdown(document), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
