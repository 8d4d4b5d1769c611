"""Execution: a scheduled step on the device.

Owns pool sizing (``memory``), the step planner that flattens a step into arrays and tensors
(``batch``), the forward runner with CUDA graphs (``runner``), the outputs read back
(``outputs``), what an engine builds on its device (``parts``) and tensor parallelism's ranks
(``tp``: launch, rank 0's page tables to the others, a rank's loop).

May import: foundations, models, requests, adapters and scheduling. Not the engine loop
(``engine.py``, ``prepare.py``) nor data parallelism.
"""
