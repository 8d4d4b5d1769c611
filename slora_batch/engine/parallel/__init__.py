"""Data parallelism: ``Engine``'s surface over worker processes, one device (or TP group) each.

Owns the driver (``data_parallel``), a worker's process (``dp_worker``) and the driver's handle
on a worker (``dp_handle``).

May import: everything below it, ``engine.py`` included (a worker runs an ``Engine``).
Nothing in the engine imports this room.
"""
