"""The gradient codec a run puts on the wire: its configuration and the builders of the CODECS
table (``--compression NAME`` with ``--compression-ratio``, ``--powersgd-rank``,
``--stochastic-rounding``).

Builders live here rather than in codecs.py because top-k and PowerSGD come wrapped in
error feedback (error_feedback.py), which itself builds on the codecs.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.comm.codecs import BF16Codec, Codec, FP16Codec, IdentityCodec, Int8Codec, PowerSGDCodec, TopKCodec
from paratrain.comm.error_feedback import ErrorFeedback
from paratrain.errors import ConfigError
from paratrain.options import check_options, option
from paratrain.registry import CODECS


@dataclass
class CodecConfig:
    """Gradient compression on the wire (``allreduce``: a DDP communication hook; parameter
    servers: each push)."""

    compression: str = option(
        "none", "gradient codec on the wire (allreduce: as a DDP communication hook)", choices=CODECS
    )
    compression_ratio: float = option(
        0.01, "topk: fraction R of each gradient's entries sent, 0 < R <= 1 (the rest is carried by error feedback)"
    )
    powersgd_rank: int = option(2, "powersgd: rank r of the low-rank approximation (Vogels et al. 2019 use 1-4)")
    stochastic_rounding: bool = option(False, "int8: round stochastically (unbiased) instead of to nearest")

    def __post_init__(self) -> None:
        check_options(self)
        if not 0 < self.compression_ratio <= 1:
            raise ConfigError(f"--compression-ratio must be in (0, 1], got {self.compression_ratio}")
        if self.powersgd_rank < 1:
            raise ConfigError(f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")

    def build(self) -> Codec:
        """The codec these settings name."""
        return make_codec(self.compression, self)

    def check(self) -> None:
        """Settings that only one codec takes, given with another (a run's, not a codec's, check:
        ``CodecConfig(stochastic_rounding=True)`` alone builds an int8 codec's settings)."""
        if self.stochastic_rounding and self.compression != "int8":
            raise ConfigError(
                f"--stochastic-rounding applies to --compression int8, this run uses --compression {self.compression}"
            )


#: The former name, kept for code written against paratrain 0.1.0.
CodecOptions = CodecConfig


def make_none(options: CodecConfig) -> Codec:
    return IdentityCodec()


def make_fp16(options: CodecConfig) -> Codec:
    return FP16Codec()


def make_bf16(options: CodecConfig) -> Codec:
    return BF16Codec()


def make_int8(options: CodecConfig) -> Codec:
    return Int8Codec(stochastic_rounding=options.stochastic_rounding)


def make_topk(options: CodecConfig) -> Codec:
    return ErrorFeedback(TopKCodec(options.compression_ratio))


def make_powersgd(options: CodecConfig) -> Codec:
    # Error feedback is what lets rank-2 PowerSGD match full-precision SGD (Vogels et
    # al. 2019, Sec. 3 and Table 2).
    return ErrorFeedback(PowerSGDCodec(rank=options.powersgd_rank))


def check_saved_codec(state: dict, codec: Codec) -> None:
    """A strategy's saved ``state`` (its ``"compression"``, ``"none"`` where absent) was
    written with ``codec``: a codec's residuals do not carry over to another."""
    written = state.get("compression", "none")
    if written != codec.name:
        raise ConfigError(
            f"checkpoint was written with --compression {written}, this run uses --compression {codec.name}"
        )


def as_codec(compression: str | Codec) -> Codec:
    """``compression`` as a codec: a registered name (with default settings) or a codec."""
    return make_codec(compression) if isinstance(compression, str) else compression


def make_codec(name: str, options: CodecConfig | None = None) -> Codec:
    """The codec registered as ``name`` (``none``, ``fp16``, ``bf16``, ``int8``, ``topk``, ``powersgd``)."""
    return CODECS.get(name)(options or CodecConfig(compression="none"))
