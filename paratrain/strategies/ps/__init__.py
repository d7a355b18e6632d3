"""Parameter-server training (``ps-sync``, ``ps-backup``, ``ps-async``).

- modes.py: the modes, their options (PSConfig) and who is who (PSTopology);
- worker.py: ParameterServerStrategy, the worker side (pull, compute, push);
- host.py: ShardHost, the shard side, which builds and runs a ShardServer;
- server.py: ShardServer, one shard's parameters, optimizer and serving threads;
- policies.py: update rules and stale-gradient policies; layout.py: the split of the
  parameters over the shards and the wire protocol.
"""

from paratrain.strategies.ps.modes import MODES, PSConfig, PSMode, PSTopology
from paratrain.strategies.ps.worker import ParameterServerStrategy

__all__ = ["MODES", "PSConfig", "PSMode", "PSTopology", "ParameterServerStrategy"]
