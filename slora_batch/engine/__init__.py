"""One base model and many LoRA adapters: requests in, results out (S-LoRA).

The engine's rooms, in the order a request flows through one step:

engine.py     Engine, the loop: pull -> schedule -> launch -> complete (prepare.py: request -> row);
              ``assemble``: an engine from other parts than the defaults (benchmark, tests)
requests/     Request, Result, tokens and stop strings, scored rows, the admitted Sequence, sampling
scheduling/   who runs this step and on which pages: scheduler, admission, KV pages, prefix cache
adapters/     disk -> host -> pool: adapter files, the host store, residency, prefetch
execution/    the step on the device: pool sizing, flat tensors, forward and CUDA graphs, outputs,
              the parts an engine is built from and builds, tensor parallelism's ranks
models/       the checkpoint: spec, one file per family behind a registry, shared layers, loader
parallel/     data parallelism: Engine's surface over worker processes, one device each
config.py, counters.py, device.py, hub.py, pool.py, resolution.py   what every room may use:
              settings, counts, device and host-to-device copies, Hub names -> cached snapshots,
              the unified page pool, what ``auto`` resolves to (device kind, dtype, kernels;
              the job manifest records it)

Imports run only downward: the foundations (last line), models/, requests/, adapters/,
scheduling/, execution/, engine.py and prepare.py, parallel/; each room's ``__init__`` says what
it owns and may import, and ``tests/test_import_graph.py`` holds the order, with no circle.

``Engine`` is imported on first use (``from slora_batch.engine import Engine`` works), so the
settings and request types load without torch.
"""


def __getattr__(name: str):
    if name == "Engine":
        from slora_batch.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'slora_batch.engine' has no attribute {name!r}")
