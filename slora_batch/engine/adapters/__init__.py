"""Adapters: disk -> host -> pool.

Owns the PEFT files and their checks without torch (``adapter_files``), the host store and its
loader thread (``store``), residency in the unified pool (slots, refcounts, LRU eviction) and
the prefetcher that reads and copies adapters ahead of their rows.

May import: foundations and models (the spec, the tensor-parallel cuts). The prefetcher reads
the scheduler's queue through the instance it is given (the type only under TYPE_CHECKING).
"""
