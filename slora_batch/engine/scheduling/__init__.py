"""Scheduling: who runs this step, and on which pages.

scheduler.py     owns a sequence's life, and each step top to bottom: running rows (decodes,
                 prefill chunks, preemption), waiting rows joining (clustering by adapter, room,
                 prefix waits), the step launched, its tokens read back (finish, hold, release)
waiting.py       the waiting queue, counting its rows per adapter (how many the adapter cap lets in)
rows.py          the running rows' table: what a decode step reads, in preallocated arrays
read_back.py     a step's drawn tokens into their rows, and which rows may finish
kv_pages.py      the pages of sequences: KV pages, cached prefix blocks, the room a row needs
prefix_cache.py  full prompt blocks of KV kept and shared by rows of the same adapter

May import: the foundations, models, requests and adapters (residency: an adapter's slot
and pages).
"""
