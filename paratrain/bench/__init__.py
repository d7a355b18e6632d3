"""Side-by-side benchmarks (``paratrain bench``); each suite measures with real runs here.

allreduce.py  paratrain's allreduce against a plain DistributedDataParallel loop
ps.py         parameter-server modes against allreduce, and under a straggler
codecs.py     gradient codecs: bytes per step, step time, accuracy
pipeline.py   GPipe vs 1F1B: bubble and activation memory against the theory
cli.py        the command: which suites, quick or full settings, one JSON and one Markdown

The scripts in benchmarks/ call the same functions with their own settings and write
the recorded results in benchmarks/results/.
"""
