"""Every ``paratrain train`` flag and TOML key of paratrain 0.1.0 is still taken, with the same
meaning: each is given once (with the other flags its strategy needs) and must land in the
run's configuration (``TrainConfig.to_dict()``, the ``config`` of the metrics file)."""

import pytest

from paratrain.config_files import load_toml
from paratrain.launch.flags import parse_train_config

PS = ["--strategy", "ps-async", "--workers", "2"]
PIPELINE = ["--strategy", "pipeline"]
ALLREDUCE = ["--strategy", "allreduce", "--workers", "2"]

# flag, value given, the option's name in the configuration, the value it must hold there, other flags
FLAGS_0_1_0 = [
    ("--model", "cifar_cnn", "model", "cifar_cnn", []),
    ("--dataset", "fashion_mnist", "dataset", "fashion-mnist", []),
    ("--data-dir", "/tmp/data", "data_dir", "/tmp/data", []),
    ("--no-download", None, "download", False, []),
    ("--max-len", "50", "max_len", 50, []),
    ("--vocab-size", "100", "vocab_size", 100, []),
    ("--strategy", "mirrored", "strategy", "allreduce", ["--workers", "2"]),
    ("--workers", "3", "workers", 3, ["--strategy", "allreduce"]),
    ("--device", "cpu", "device", "cpu", []),
    ("--ps-shards", "2", "ps_shards", 2, PS),
    ("--backup-workers", "1", "backup_workers", 1, ["--strategy", "ps-backup", "--workers", "2"]),
    ("--staleness-bound", "2", "staleness_bound", 2, PS),
    ("--stale-policy", "scale-lr", "stale_policy", "scale-lr", PS),
    ("--max-staleness", "6", "max_staleness", 6, PS + ["--stale-policy", "drop"]),
    ("--warmup-steps", "5", "warmup_steps", 5, PS),
    ("--pull-compression", "bf16", "pull_compression", "bf16", PS),
    ("--heartbeat-timeout", "4", "heartbeat_timeout", 4.0, PS),
    ("--stages", "3", "stages", 3, PIPELINE + ["--microbatches", "4"]),
    ("--microbatches", "8", "microbatches", 8, PIPELINE),
    ("--schedule", "gpipe", "schedule", "gpipe", PIPELINE),
    ("--balance", "time", "balance", "time", PIPELINE),
    ("--split-points", "2", "split_points", "2", PIPELINE),
    ("--fail", "1@40", "fail", "1@40", ALLREDUCE),
    ("--hang", "1@40", "hang", "1@40", ALLREDUCE),
    ("--straggler", "1:2.5", "straggler", "1:2.5", ALLREDUCE),
    ("--epochs", "4", "epochs", 4, []),
    ("--batch-size", "64", "batch_size", 64, []),
    ("--lr", "0.1", "lr", 0.1, []),
    ("--optimizer", "adam", "optimizer", "adam", []),
    ("--momentum", "0.5", "momentum", 0.5, []),
    ("--weight-decay", "0.001", "weight_decay", 0.001, []),
    ("--lr-schedule", "exponential", "lr_schedule", "exponential", []),
    ("--lr-decay-rate", "0.5", "lr_decay_rate", 0.5, []),
    ("--lr-decay-steps", "100", "lr_decay_steps", 100, []),
    ("--no-staircase", None, "staircase", False, []),
    ("--warmup-epochs", "2", "warmup_epochs", 2.0, []),
    ("--reference-batch", "128", "reference_batch", 128, []),
    ("--compression", "fp16", "compression", "fp16", ALLREDUCE),
    ("--compression-ratio", "0.1", "compression_ratio", 0.1, ALLREDUCE + ["--compression", "topk"]),
    ("--powersgd-rank", "4", "powersgd_rank", 4, ALLREDUCE + ["--compression", "powersgd"]),
    ("--stochastic-rounding", None, "stochastic_rounding", True, ALLREDUCE + ["--compression", "int8"]),
    ("--early-stopping", "3", "early_stopping", 3, []),
    ("--seed", "7", "seed", 7, []),
    ("--log-every", "10", "log_every", 10, []),
    ("--no-progress", None, "progress", False, []),
    ("--checkpoint-dir", "/tmp/ck", "checkpoint_dir", "/tmp/ck", []),
    ("--checkpoint-every", "20", "checkpoint_every", 20, []),
    ("--keep", "2", "keep", 2, []),
    ("--resume", None, "resume", True, ["--checkpoint-dir", "/tmp/ck"]),
    ("--max-restarts", "1", "max_restarts", 1, ["--checkpoint-dir", "/tmp/ck"]),
    ("--on-nan", "skip", "on_nan", "skip", []),
    ("--timeout", "30", "timeout", 30.0, []),
    ("--metrics-out", "/tmp/m.json", "metrics_out", "/tmp/m.json", []),
    ("--logdir", "/tmp/runs", "logdir", "/tmp/runs", []),
    ("--timeline", "/tmp/t.json", "timeline", "/tmp/t.json", []),
]


@pytest.mark.parametrize("flag, value, name, expected, others", FLAGS_0_1_0, ids=[f[0] for f in FLAGS_0_1_0])
def test_every_flag_of_0_1_0_is_taken(flag, value, name, expected, others):
    argv = [*others, flag] + ([value] if value is not None else [])
    assert parse_train_config(argv).to_dict()[name] == expected


@pytest.mark.parametrize("flag, value, name, expected, others", FLAGS_0_1_0, ids=[f[0] for f in FLAGS_0_1_0])
def test_every_toml_key_of_0_1_0_is_taken(tmp_path, flag, value, name, expected, others):
    """The same option as a TOML key, in both spellings (dashes and underscores)."""
    for key in (name, name.replace("_", "-")):
        path = tmp_path / "run.toml"
        literal = repr(expected).lower() if isinstance(expected, bool) else repr(expected).replace("'", '"')
        path.write_text(f"{key} = {literal}\n")
        assert load_toml(str(path))[name] == expected
        assert parse_train_config(["--config", str(path), *others]).to_dict()[name] == expected
