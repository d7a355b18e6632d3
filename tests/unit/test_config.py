import pytest

from paratrain.config import TrainConfig, make_config
from paratrain.config_files import load_toml
from paratrain.errors import ConfigError


def test_defaults_are_the_documented_run():
    config = TrainConfig()
    assert (config.model, config.dataset, config.strategy, config.workers) == ("mlp", "digits", "single", 1)
    assert config.global_batch == config.batch_size


def test_alias_resolves_to_canonical_name():
    assert TrainConfig(strategy="mirrored", workers=2).strategy == "allreduce"


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"workers": 0}, ["--workers", ">= 1"]),
        ({"strategy": "nope"}, ["strategy 'nope'", "allreduce", "single"]),
        ({"model": "resnet"}, ["model 'resnet'", "mlp"]),
        ({"dataset": "imagenet"}, ["dataset 'imagenet'", "digits"]),
        ({"optimizer": "lbfgs"}, ["optimizer 'lbfgs'", "adam", "sgd"]),
        ({"lr": -1.0}, ["--lr", "> 0"]),
        ({"batch_size": 0}, ["--batch-size"]),
        ({"device": "tpu"}, ["--device", "auto, cpu, cuda"]),
        ({"workers": 2}, ["--strategy single", "--workers 2", "allreduce"]),
        ({"epochs": "3"}, ["--epochs must be int"]),
        ({"metrics_out": "/no/such/dir/m.json"}, ["--metrics-out", "does not exist"]),
        ({"resume": True}, ["--resume needs --checkpoint-dir"]),
        ({"max_restarts": 2}, ["--max-restarts needs --checkpoint-dir"]),
        ({"max_restarts": -1}, ["--max-restarts", ">= 0"]),
        ({"checkpoint_dir": "d", "checkpoint_every": 0}, ["--checkpoint-every", ">= 1"]),
        ({"checkpoint_dir": "d", "keep": 0}, ["--keep", ">= 1"]),
        ({"checkpoint_async": True}, ["--checkpoint-async needs --checkpoint-dir"]),
        (
            {"checkpoint_dir": "d", "checkpoint_async": True, "strategy": "ps-sync", "workers": 2},
            ["--checkpoint-async", "--strategy ps-sync", "commit from a thread", "allreduce", "fsdp-ft", "tensor"],
        ),
        ({"on_nan": "ignore"}, ["--on-nan", "stop, skip"]),
        ({"hang": "1@x"}, ["--hang", "WORKER@STEP"]),
        ({"hang": "3@5", "strategy": "allreduce", "workers": 2}, ["--hang names worker 3", "0..1"]),
        ({"fail": "ps:x@5", "strategy": "ps-async", "workers": 2}, ["--fail must be", "ps:SHARD@VERSION", "'ps:x@5'"]),
        ({"fail": "ps:0@0", "strategy": "ps-async", "workers": 2}, ["--fail ps:0@0", ">= 1"]),
        ({"fail": "ps:1@9", "strategy": "ps-sync", "workers": 2}, ["names shard 1", "shards 0..0"]),
        ({"fail": "ps:0@9", "strategy": "allreduce", "workers": 2}, ["--strategy allreduce has none", "WORKER@STEP"]),
    ],
)
def test_bad_values_name_the_flag_and_what_is_valid(changes, words):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**changes)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_fail_names_a_worker_or_a_shard():
    worker = TrainConfig(strategy="ps-async", workers=2, fail="1@40")
    assert (worker.faults.fail_at, worker.faults.fail_shard_at) == ((1, 40), None)
    shard = TrainConfig(strategy="ps-async", workers=2, ps_shards=2, fail="ps:1@100")
    assert (shard.faults.fail_at, shard.faults.fail_shard_at) == (None, (1, 100))


def test_toml_file_and_flags_on_top(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "allreduce"\nworkers = 2\nbatch-size = 16\nlr = 0.1\n')
    config = make_config(load_toml(str(path)), {"lr": 0.2})
    assert (config.strategy, config.workers, config.batch_size, config.lr) == ("allreduce", 2, 16, 0.2)
    assert config.global_batch == 32


def test_toml_accepts_a_train_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nepochs = 3\n")
    assert make_config(load_toml(str(path)), {}).epochs == 3


@pytest.mark.parametrize(
    "text, words",
    [
        ("bogus = 1\n", ["unknown key 'bogus'", "batch-size"]),
        ("epochs = \n", ["not valid TOML"]),
        ('epochs = "ten"\n', ["--epochs must be int"]),
    ],
)
def test_bad_toml_files(tmp_path, text, words):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        make_config(load_toml(str(path)), {})
    for word in words:
        assert word in str(error.value)


def test_missing_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_toml(str(tmp_path / "absent.toml"))


def test_fault_tolerant_makes_each_strategy_its_ft_strategy_and_refuses_the_others():
    from paratrain.config import TrainConfig

    assert TrainConfig(strategy="allreduce", fault_tolerant=True).strategy == "allreduce-ft"
    assert TrainConfig(strategy="pipeline", fault_tolerant=True, workers=2, stages=2).strategy == "pipeline-ft"
    assert TrainConfig(strategy="allreduce-ft", fault_tolerant=True).strategy == "allreduce-ft"
    assert TrainConfig(strategy="local-sgd", fault_tolerant=True, sync_every=4).strategy == "local-sgd-ft"
    assert TrainConfig(strategy="diloco", fault_tolerant=True, outer_lr=0.5).strategy == "diloco-ft"
    assert TrainConfig(strategy="fsdp", fault_tolerant=True, workers=4, shards_per_replica=2).strategy == "fsdp-ft"
    for strategy in ("tensor", "ps-sync", "single"):
        with pytest.raises(ConfigError, match=f"--strategy {strategy} has no fault tolerance of its own yet"):
            TrainConfig(strategy=strategy, fault_tolerant=True)
