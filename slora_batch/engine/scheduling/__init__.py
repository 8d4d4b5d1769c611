"""Scheduling: who runs this step, and on which pages.

scheduler.py     owns a sequence's life: admit, chunked prefill, finish, hold, release, preempt
admission.py     how waiting rows join a step: clustering by adapter, room, prefix waits
kv_pages.py      the pages of sequences: KV pages, cached prefix blocks, the room a row needs
prefix_cache.py  full prompt blocks of KV kept and shared by rows of the same adapter

May import: the foundations, models, requests and adapters (residency: an adapter's slot
and pages).
"""
