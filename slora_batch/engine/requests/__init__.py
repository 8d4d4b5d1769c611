"""Requests and results: what goes in, what comes out, and a row's state in between.

Owns ``Request`` / ``Result``, tokenization and incremental detokenization with stop strings,
scored rows (continuations, choices, logprobs), the admitted ``Sequence`` and the sampler.

May import: the engine's foundations (``config``, ``counters``, ``device``, ``pool``).
Nothing from models, adapters, scheduling, execution or parallel.
"""
