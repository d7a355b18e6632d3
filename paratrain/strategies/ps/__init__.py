"""Parameter-server training (``ps-sync``, ``ps-backup``, ``ps-async``).

Start with strategy.py (ParameterServerStrategy: joins the run, composes the process's role, runs the step)
and modes.py (the modes, PSConfig, PSTopology); worker.py and host.py are the two roles; protocol/ is how a
worker and a shard talk (wire.py packs every message); policies.py holds the update rules. See
docs/parameter_server.md.
"""
