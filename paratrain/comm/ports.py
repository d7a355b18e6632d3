"""The range of TCP ports a run's rendezvous may take: ``PARATRAIN_PORT_RANGE=LOW-HIGH`` (say,
the ports a firewall opens, or a range of its own for each of several runs started at once
on one machine). Unset, a run started here takes one the kernel picks, and a run of SLURM
tasks one derived from its job id (comm/slurm.py)."""

from __future__ import annotations

from collections.abc import Mapping

from paratrain.errors import ConfigError

PORT_RANGE_ENV = "PARATRAIN_PORT_RANGE"


def port_range(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``PARATRAIN_PORT_RANGE`` of ``env`` as (low, high), both taken; None where unset."""
    span = env.get(PORT_RANGE_ENV)
    if not span:
        return None
    try:
        low, high = (int(part) for part in span.split("-"))
        assert 0 < low <= high < 65536
    except (ValueError, AssertionError):
        raise ConfigError(f"{PORT_RANGE_ENV} must be LOW-HIGH, two ports (say 20000-24999), got {span!r}") from None
    return low, high
