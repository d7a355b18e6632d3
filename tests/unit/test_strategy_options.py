"""Options of local-sgd, diloco and fsdp: where they apply, and what they refuse."""

import dataclasses
import json

import pytest

from paratrain.config import TrainConfig
from paratrain.errors import ConfigError
from paratrain.strategies.averaging.anchors import fragment_groups


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"strategy": "local-sgd", "outer_lr": 0.5},
            "--outer-lr applies to --strategy diloco and diloco-ft, not to --strategy local-sgd",
        ),
        # given at its default value, an option is still given: refused, never ignored
        (
            {"strategy": "local-sgd", "outer_momentum": 0.9},
            "--outer-momentum applies to --strategy diloco and diloco-ft, not to --strategy local-sgd",
        ),
        (
            {"strategy": "allreduce", "sync_every": 8},
            "--sync-every applies to --strategy local-sgd, diloco, local-sgd-ft and diloco-ft, not to --strategy allreduce",
        ),
        (
            {"strategy": "single", "ps_shards": 1},
            "--ps-shards applies to the ps-* strategies, not to --strategy single",
        ),
        (
            {"strategy": "allreduce", "sync_every": 4},
            "--sync-every applies to --strategy local-sgd, diloco, local-sgd-ft and diloco-ft, not to --strategy allreduce",
        ),
        (
            {"strategy": "diloco", "sync_every": 10, "fragments": 3},
            "--fragments 3 must divide --sync-every 10 (one fragment is synchronized every H/F steps)",
        ),
        ({"strategy": "diloco", "outer_momentum": 1.0}, "--outer-momentum must be < 1, got 1.0"),
        ({"strategy": "diloco", "sync_every": 0}, "--sync-every must be >= 1, got 0"),
        (
            {"strategy": "ps-sync", "shared_memory": False},
            "--no-shared-memory applies to --strategy allreduce, allreduce-ft, pipeline-ft, fsdp-ft, local-sgd-ft and diloco-ft, not to --strategy ps-sync",
        ),
        (
            {"strategy": "ps-sync", "shared_memory": True},
            "--shared-memory applies to --strategy allreduce, allreduce-ft, pipeline-ft, fsdp-ft, local-sgd-ft and diloco-ft, not to --strategy ps-sync",
        ),
        (
            {"strategy": "allreduce", "reshard_after_forward": False},
            "--no-reshard-after-forward applies to --strategy fsdp and fsdp-ft, not to --strategy allreduce",
        ),
        (
            {"strategy": "fsdp", "compression": "int8"},
            "--compression int8: fsdp reduce-scatters gradients, which only none, fp16 and bf16 can be (a coded payload cannot be summed shard by shard); use one of those, or --strategy allreduce",
        ),
        (
            {"strategy": "fsdp", "precision": "fp16"},
            "--precision fp16 needs a gradient scaler that fsdp's sharded gradients do not have here; use --precision bf16",
        ),
        ({"strategy": "fsdp", "compile": True}, "--compile is not available with --strategy fsdp"),
    ],
)
def test_refused_with_one_line(options, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**options)
    assert str(caught.value) == message


def test_flags_given_at_their_defaults_are_refused_but_a_written_run_is_not(tmp_path):
    """From the command line, a flag given is refused even at its default; the options of an
    earlier run (--config-from: every option written) count only where they differ."""
    from paratrain.launch.flags import parse_train_config

    with pytest.raises(ConfigError, match="--outer-momentum applies to --strategy diloco"):
        parse_train_config(["--strategy", "local-sgd", "--outer-momentum", "0.9"])
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"config": TrainConfig(strategy="allreduce", workers=2).to_dict()}))
    config = parse_train_config(["--config-from", str(run), "--strategy", "local-sgd"])
    assert config.strategy == "local-sgd" and config.averaging.outer_momentum == 0.9
    assert config.replace(workers=3).workers == 3  # a copy keeps what was given
    with pytest.raises(ConfigError, match="--sync-every applies to"):
        config.replace(strategy="allreduce", sync_every=8)


def test_taken_where_they_apply():
    config = TrainConfig(strategy="diloco", workers=4, sync_every=20, fragments=4, outer_lr=0.5, compression="fp16")
    assert (config.averaging.sync_every, config.averaging.fragments, config.averaging.outer_lr) == (20, 4, 0.5)
    assert config.global_batch == 4 * 32
    assert TrainConfig(strategy="local-sgd", local_after=100).averaging.local_after == 100
    assert TrainConfig(strategy="fsdp", reshard_after_forward=False).fsdp.reshard_after_forward is False
    assert TrainConfig(strategy="fsdp", workers=3).topology.model_part(2) == "rank-0"
    assert TrainConfig(strategy="local-sgd", workers=3).topology.model_part(2) == "rank-2"  # replicas differ


@pytest.mark.parametrize(
    ("sizes", "count", "expected"),
    [
        ([10, 10, 10, 10], 2, [[0, 1], [2, 3]]),
        ([100, 1, 1, 1], 2, [[0], [1, 2, 3]]),
        ([1, 1, 100], 3, [[0], [1], [2]]),
        ([5], 1, [[0]]),
    ],
)
def test_fragments_are_contiguous_and_balanced(sizes, count, expected):
    assert fragment_groups(sizes, count) == expected


def test_bucket_cap_mb_is_allreduces():
    assert TrainConfig(strategy="mirrored", workers=2, bucket_cap_mb=4).allreduce.bucket_cap_mb == 4.0
    with pytest.raises(ConfigError, match="--bucket-cap-mb applies to --strategy allreduce, not to --strategy fsdp"):
        TrainConfig(strategy="fsdp", bucket_cap_mb=4)
    with pytest.raises(ConfigError, match="--bucket-cap-mb must be > 0, got 0"):
        TrainConfig(strategy="allreduce", bucket_cap_mb=0)


def test_a_codecs_per_rank_state_starts_empty_on_another_number_of_replicas():
    from paratrain.strategies.allreduce.strategy import AllReduceStrategy
    from paratrain.strategies.topology import Topology

    strategy = AllReduceStrategy(device="cpu", compression="topk")
    strategy.topology = Topology(num_replicas=3)
    state = {"name": "allreduce", "steps": 5, "compression": "topk", "hook": {"residuals": 1}}
    assert strategy.reshard_state(state, saved_replicas=3) is state
    assert strategy.reshard_state(state, saved_replicas=2) == {**state, "hook": {}}


def _section_options():
    """(section, option, the strategies that take it) for every option of every strategy's
    section: what the sections declare, the one place that says it."""
    from paratrain.config import SECTIONS
    from paratrain.options import option_fields, takers

    return [
        (name, f.name, takers(section, f.name))
        for name, section in SECTIONS.items()
        if hasattr(section, "strategies")
        for f in option_fields(section)
    ]


def test_every_strategy_a_section_names_is_a_strategy_and_every_strategy_is_covered():
    from paratrain.registry import STRATEGIES

    named = {s for _, _, who in _section_options() for s in who}
    assert named <= set(STRATEGIES.names(with_aliases=False))
    assert len(_section_options()) > 20


@pytest.mark.parametrize(("section", "name", "takers"), _section_options())
def test_an_option_is_refused_by_every_strategy_that_does_not_take_it(section, name, takers):
    """Given at its default value, by each strategy outside its takers: one line naming them."""
    from paratrain.config import SECTIONS
    from paratrain.options import flag
    from paratrain.registry import STRATEGIES

    default = next(f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    refusing = [s for s in STRATEGIES.names(with_aliases=False) if s not in takers]
    assert refusing
    for strategy in refusing:
        with pytest.raises(ConfigError, match=f"^{flag(name)} applies to .*, not to --strategy {strategy}$"):
            TrainConfig(strategy=strategy, **{name: default})
