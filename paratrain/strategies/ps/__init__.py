"""Parameter-server training (``ps-sync``, ``ps-backup``, ``ps-async``).

- modes.py: the modes, their options (PSConfig) and who is who (PSTopology);
- worker.py: ParameterServerStrategy, the worker side (pull, compute, push);
- host.py: ShardHost, the shard side, which builds and runs a ShardServer;
- protocol/: how a worker and a shard talk: wire.py (the message header and reply, packed
  and read in one place), links.py (a link between a shard and one worker), client.py
  (ShardClient, the worker's side), server.py (ShardServer, one shard's parameters,
  optimizer and serving threads);
- policies.py: update rules and stale-gradient policies; layout.py: the split of the
  parameters over the shards.
"""
