"""Models: what a checkpoint is and how its forward runs over the page pool.

Owns the spec reader (``config.json`` -> shapes, page geometry), the model families (one file
each, picked by the checkpoint's ``architectures`` in ``registry``), the layers they share
(RMSNorm through the kernel backend, RoPE variants, the LoRA-decomposed projection), the
tensor-parallel cuts of the weights (``shard``), the safetensors loader and the built-in sample.

May import: the engine's foundations (``config``, ``counters``, ``device``, ``pool``) and
``kernels``. Nothing from requests, adapters, scheduling, execution or parallel.
"""
