"""What-if simulation of a training cluster (``paratrain simulate``).

cluster.py   nodes, links, stragglers, failures, codecs: the cost model
simulator.py the discrete-event engine; one object per strategy (STRATEGIES)
virtual.py   virtual-cluster training: real training on the simulated schedule
cli.py       flags, table, JSON; plots.py the figures

Imports here are lazy so that ``paratrain --help`` stays fast.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("Cluster", "parse_straggler", "make_codec"):
        from paratrain.simulate import cluster  # deferred: lazy package attribute (see the docstring)

        return getattr(cluster, name)
    if name in ("simulate", "STRATEGIES", "Outcome"):
        from paratrain.simulate import simulator  # deferred: lazy package attribute (see the docstring)

        return getattr(simulator, name)
    raise AttributeError(name)
