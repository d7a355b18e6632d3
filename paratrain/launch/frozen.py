"""Imported last by a local launch's fork server (``process.process_context``), once the
preloaded modules are in: their objects go to the permanent generation (``gc.freeze``), so
that no process forked from the server traverses them in a garbage collection. Without
this every collection of a run's process walked torch's and paratrain's module objects,
~290,000 of them: a full collection (a strategy's teardown makes one) cost ~0.18 s, and the
automatic ones their share of every step. Objects made after the fork are collected as
always; the frozen ones live as long as the process, as modules do.
"""

import gc

gc.freeze()
