"""TensorFlow's half of benchmarks/tensorflow_mirrored.py: one run of a model under a
``tf.distribute`` strategy, in TensorFlow's own environment (TensorFlow is never a
dependency of paratrain), and what both halves share: the models' shapes and batches, the
optimizer's constants, and how a run's result is summed up. Standard library only at the
top, so that either environment imports it.

    TF_PYTHON benchmarks/tensorflow_side.py MODEL DATA.npz mirrored|default[+bf16] EPOCHS

prints the run's result as one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys

MODELS = {
    "mlp": {"shape": (28, 28), "classes": 10, "batch": 128, "kind": "image"},
    "cifar_cnn": {"shape": (24, 24, 3), "classes": 10, "batch": 128, "kind": "image"},
    "lstm": {"shape": (200,), "classes": 2, "batch": 64, "kind": "tokens", "vocab": 20000},
    "plain_cnn": {"shape": (24, 24, 3), "classes": 10, "batch": 128, "kind": "image"},
}
REPLICAS = 2
LR = 0.01
MOMENTUM = 0.9


def tf_run(name: str, data: str, strategy_name: str, epochs: int) -> dict:
    import time

    import numpy as np
    import tensorflow as tf

    strategy_name, _, precision = strategy_name.partition("+")
    if precision == "bf16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    if strategy_name == "mirrored":
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    else:
        strategy = tf.distribute.get_strategy()
    spec = MODELS[name]
    arrays = np.load(data)
    x, y = arrays["x"], arrays["y"]
    global_batch = spec["batch"] * REPLICAS
    steps = len(x) // global_batch
    layers = tf.keras.layers
    with strategy.scope():
        if name == "mlp":
            model = tf.keras.Sequential(
                [
                    layers.Input(spec["shape"]),
                    layers.Flatten(),
                    layers.Dense(256, activation="relu"),
                    layers.Dense(10, dtype="float32"),
                ]
            )
        elif name == "plain_cnn":
            model = tf.keras.Sequential(
                [
                    layers.Input(spec["shape"]),
                    layers.Conv2D(64, 5, padding="same", activation="relu"),
                    layers.MaxPooling2D(3, 2, padding="same"),
                    layers.Conv2D(64, 5, padding="same", activation="relu"),
                    layers.MaxPooling2D(3, 2, padding="same"),
                    layers.Flatten(),
                    layers.Dense(384, activation="relu"),
                    layers.Dense(192, activation="relu"),
                    layers.Dense(10, dtype="float32"),
                ]
            )
        elif name == "cifar_cnn":

            def lrn(t):
                # TensorFlow's CPU LRN kernel takes float32 (and half) only: under mixed_bfloat16
                # the normalization runs in float32, as a user of that policy would write it
                out = tf.nn.local_response_normalization(
                    tf.cast(t, tf.float32), depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75
                )
                return tf.cast(out, t.dtype)

            model = tf.keras.Sequential(
                [
                    layers.Input(spec["shape"]),
                    layers.Conv2D(64, 5, padding="same", activation="relu"),
                    layers.MaxPooling2D(3, 2, padding="same"),
                    layers.Lambda(lrn),
                    layers.Conv2D(64, 5, padding="same", activation="relu"),
                    layers.Lambda(lrn),
                    layers.MaxPooling2D(3, 2, padding="same"),
                    layers.Flatten(),
                    layers.Dense(384, activation="relu"),
                    layers.Dense(192, activation="relu"),
                    layers.Dense(10, dtype="float32"),
                ]
            )
        else:
            model = tf.keras.Sequential(
                [
                    layers.Input(spec["shape"], dtype="int64"),
                    layers.Embedding(spec["vocab"], 64),
                    layers.LSTM(128),
                    layers.Dense(spec["classes"], dtype="float32"),
                ]
            )
        model.compile(
            optimizer=tf.keras.optimizers.SGD(LR, momentum=MOMENTUM),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True).cache().repeat()
    dataset = dataset.prefetch(tf.data.AUTOTUNE)

    class Timer(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.faults = time.perf_counter(), minor_faults()

        def on_epoch_end(self, epoch, logs=None):
            rates.append(steps * global_batch / (time.perf_counter() - self.start))
            faults.append((minor_faults() - self.faults) / steps)

    rates: list[float] = []
    faults: list[float] = []
    model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[Timer()])
    return steady(rates, faults)


def minor_faults() -> int:
    """This process's minor page faults so far: each is a page the kernel maps and zero-fills
    on first touch, what an allocator that returns freed memory to the system pays again
    every step."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def steady(rates: list[float], faults: list[float]) -> dict:
    """A run's result: the median of its epochs after the first, examples/s and minor page
    faults a step (the measuring process's: TensorFlow's only one, paratrain's chief)."""
    return {
        "examples_per_second": statistics.median(rates[1:]),
        "epochs": rates,
        "faults_per_step": statistics.median(faults[1:]),
    }


if __name__ == "__main__":
    name, data, strategy, epochs = sys.argv[1:5]
    print(json.dumps(tf_run(name, data, strategy, int(epochs))))
