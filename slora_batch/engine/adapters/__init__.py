"""Adapters: disk -> host -> pool.

adapter_files.py  PEFT directories: listing, parsing, validation against the model (no torch)
expert_files.py   LoRA on a mixture-of-experts block's experts: PEFT's two formats, each expert
                  target's rank and scale (no torch)
expert_weights.py the experts' tensors read into the rows their pages hold
store.py          the host store of adapter weights and its loader thread; the TP cut of an adapter
residency.py      adapters resident in the pool: slots, refcounts, LRU eviction
prefetch.py       adapters ahead of their rows: disk -> host, host -> device pages

May import: the foundations and models (the spec). The prefetcher reads the scheduler's
waiting queue through the instance it is given (its type only under TYPE_CHECKING).
"""
