"""Data parallelism: ``Engine``'s surface over worker processes, one device (or TP group) each.

data_parallel.py  DataParallelEngine, the driver: splits the stream, merges the results
dp_worker.py      a data-parallel worker: its device(s), its engine, its pipes to the driver
dp_handle.py      the driver's handle on a worker: its share of the stream, what rows still owe

May import: every room below it and ``engine.py`` (a worker runs an ``Engine``).
"""
