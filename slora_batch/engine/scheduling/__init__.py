"""Scheduling: who runs this step, and on which pages.

Owns the scheduler (a sequence's life: admit, chunked prefill, finish, hold, release,
preempt), admission of waiting rows, the KV pages of sequences and the prefix cache.

May import: foundations, models, requests and adapters (residency, for an adapter's slot and
pages). Nothing from execution or parallel.
"""
