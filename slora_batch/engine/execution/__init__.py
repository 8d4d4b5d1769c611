"""Execution: a scheduled step on the device.

memory.py   how many pages the pool gets (and the reserve for a step's temporaries)
batch.py    the one step planner: a scheduled step as flat arrays for the model and kernels
lora_layout.py  tokens grouped by adapter slot for the LoRA kernels, and their LoraMeta
runner.py   runs a planned step: eager, or a replayed CUDA graph for decode steps
outputs.py  a step's outputs on the device (tokens, scores, logprobs) until they are read back
parts.py    what an engine builds on its device (store, model, pool, residency, runner)
tp.py       tensor parallelism's ranks: launch, rank 0's plan to the others, a rank's loop
tp_tables.py  the page table sent to the other ranks as per-sequence deltas, and rebuilt there

May import: the foundations, models, requests, adapters and scheduling.
"""
