"""The compression flags: validation, what the strategy builds from them, bad input."""

import pytest

import paratrain
from paratrain.comm.codecs import BF16Codec, Int8Codec, PowerSGDCodec, TopKCodec
from paratrain.comm.error_feedback import ErrorFeedback
from paratrain.config import TrainConfig
from paratrain.errors import ConfigError

ALLREDUCE = {"strategy": "allreduce", "workers": 2}


def test_defaults():
    config = TrainConfig()
    codec = config.codec
    assert (codec.compression, codec.compression_ratio, codec.powersgd_rank, codec.stochastic_rounding) == (
        "none",
        0.01,
        2,
        False,
    )


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"compression": "fp16"}, ["--compression fp16", "--strategy single", "strategies that take it: allreduce"]),
        ({**ALLREDUCE, "compression": "zip"}, ["unknown codec 'zip'", "bf16, fp16, int8, none, powersgd, topk"]),
        ({**ALLREDUCE, "compression": "topk", "compression_ratio": 0.0}, ["--compression-ratio must be in (0, 1]"]),
        ({**ALLREDUCE, "compression": "topk", "compression_ratio": 1.5}, ["--compression-ratio must be in (0, 1]"]),
        ({**ALLREDUCE, "compression": "powersgd", "powersgd_rank": 0}, ["--powersgd-rank must be >= 1"]),
        ({**ALLREDUCE, "compression": "fp16", "stochastic_rounding": True}, ["--stochastic-rounding", "int8"]),
        ({**ALLREDUCE, "compression_ratio": "1%"}, ["--compression-ratio must be float"]),
    ],
)
def test_bad_values_name_the_flag_and_what_is_valid(changes, words):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**changes)
    assert "\n" not in str(error.value)
    for word in words:
        assert word in str(error.value)


def test_from_config_builds_the_named_codec_with_its_options():
    def codec(**changes):
        return paratrain.AllReduceStrategy.from_config(TrainConfig(**ALLREDUCE, **changes)).codec

    assert isinstance(codec(compression="bf16"), BF16Codec)
    assert codec(compression="int8", stochastic_rounding=True).stochastic_rounding
    topk = codec(compression="topk", compression_ratio=0.05)
    assert isinstance(topk, ErrorFeedback) and isinstance(topk.inner, TopKCodec) and topk.inner.ratio == 0.05
    powersgd = codec(compression="powersgd", powersgd_rank=4)
    assert isinstance(powersgd.inner, PowerSGDCodec) and powersgd.inner.rank == 4
    assert codec().name == "none"


def test_strategy_takes_a_codec_object_and_describes_it():
    strategy = paratrain.AllReduceStrategy(device="cpu", compression=ErrorFeedback(Int8Codec()))
    assert strategy.codec.name == "int8"
    assert paratrain.AllReduceStrategy(device="cpu", compression="topk").codec.name == "topk"
    assert paratrain.SingleDeviceStrategy.takes_compression is False


def test_cli_compression_with_single_is_one_line_and_exit_2(cli):
    result = cli("train", "--epochs", "1", "--compression", "fp16")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "--compression fp16: --strategy single sends no gradients to compress" in lines[0]
    assert "strategies that take it: allreduce" in lines[0]
