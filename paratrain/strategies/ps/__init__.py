"""Parameter-server training (``ps-sync``, ``ps-backup``, ``ps-async``).

- modes.py: the modes, their options (PSConfig) and who is who (PSTopology);
- strategy.py: ParameterServerStrategy, which joins the run, composes the process's role
  and runs the step (compute, then push and pull) with the run's policies;
- worker.py: PSWorker, a worker's side of the wire (its flat buffers, buffers.py; what it
  asks the shards; the run's statistics, statistics.py);
- host.py: ShardHost, a shard's server role, which builds and runs a ShardServer;
- protocol/: how a worker and a shard talk: wire.py (the message header and reply, packed
  and read in one place), links.py (a link between a shard and one worker), client.py
  (ShardClient, the worker's side), server.py (ShardServer, one shard's parameters,
  optimizer and serving threads);
- policies.py: update rules and stale-gradient policies; layout.py: the split of the
  parameters over the shards.
"""
