"""The engines alive in this process, per device, and the memory each holds: a new engine that
does not fit beside them fails before it allocates, with a message that names them.

The case it is for: a notebook cell ``eng = Engine(...)`` run again builds the new engine
while the old one is still bound to ``eng``, so the new one gets what the old one left (its
pool is sized from free memory) or, for a larger model, CUDA's out-of-memory error from deep
inside. Engines are held by weak references: one that is dropped (or closed) leaves at once.
"""

from __future__ import annotations

import gc
import logging
import re
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slora_batch.engine.execution import memory
from slora_batch.engine.execution.memory import GIB, DeviceMemoryError
from slora_batch.engine.pool import PagePool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holding:
    model: str  # as the engine was given it: a path, a Hub name or the sample's alias
    device: str  # "cuda:0"
    bytes: int  # device memory the engine took (cuda: measured; elsewhere weights and pool)


_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> Holding


def device_key(device: torch.device) -> str:
    """``cuda`` and ``cuda:0`` alike name the card: "cuda:<index>"."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def release(engine: object) -> None:
    _LIVE.pop(engine, None)


def holders(device: torch.device) -> list[Holding]:
    """The live engines on ``device``. Garbage is collected first when there are any: an engine
    dropped inside a reference cycle frees its memory (and leaves the list) only then."""
    key = device_key(device)
    if not any(h.device == key for h in list(_LIVE.values())):
        return []
    gc.collect()
    return [h for h in list(_LIVE.values()) if h.device == key]


class Room:
    """A new engine's place on its device: built before it allocates, it raises
    ``DeviceMemoryError`` when the engine cannot fit (its weights, from ``spec``, a rank's
    shard, unless handed in as a dict of tensors, which are counted where they are; and
    ``memory.min_engine_bytes``) in what is free beside the live engines."""

    def __init__(self, model: str, spec, config, dtype, device, max_model_len, weights) -> None:
        self.model, self.device = model, device
        fp8 = config.weights == "fp8"
        self.weights = 0 if isinstance(weights, dict) else memory.weight_bytes(spec, dtype, fp8)
        rest = memory.min_engine_bytes(config, spec, dtype, device, max_model_len)
        self.allocated_before = memory.allocated_bytes(device)
        self.undo: list[Callable[[], object]] = []
        if memory.device_memory(device) is None:  # nothing counted (the CPU): nothing to check
            return
        others = holders(device)  # first: a dropped engine's memory is free once it is collected
        free, total = memory.device_memory(device)
        if self.weights + rest > free:
            need = self.weights + rest
            raise memory_error(
                model,
                device,
                f"it needs at least {_gib(need)} (weights "
                f"{_gib(self.weights)}, pool and one step's activations "
                f"{_gib(rest)}) and {_gib(free)} of {_gib(total)} are free",
                others,
            )
        if others:
            log.warning(
                "%d other engine(s) of this process hold %s on %s (%s): this engine's "
                "pool gets what they leave; close() them first for the whole card",
                len(others),
                _gib(sum(h.bytes for h in others)),
                device_key(device),
                ", ".join(h.model for h in others),
            )

    def on_failure(self, undo: Callable[[], object]) -> None:
        """``undo`` runs if the build fails (before its error is raised)."""
        self.undo.append(undo)

    def __enter__(self) -> Room:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """A failed build is undone. CUDA's out-of-memory error (or the pool's
        ``DeviceMemoryError``) becomes the error that names the live engines; its frames are
        cleared first, so that the tensors they hold are freed while the error is shown (a
        notebook keeps the last one)."""
        if exc is None:
            return
        for undo in reversed(self.undo):
            undo()
        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            return
        traceback.clear_frames(tb)
        free_cached(self.device)
        raise memory_error(
            self.model, self.device, what_ran_out(exc), holders(self.device)
        ) from None

    def hold(self, engine: object, *pools: PagePool) -> int:
        """Registers the built engine; returns the bytes it took: measured where the device
        counts them, else its weights and pools."""
        allocated = memory.allocated_bytes(self.device)
        if allocated is None:
            pool_bytes = sum(p.data.nbytes for p in {id(p): p for p in pools}.values())
            taken = self.weights + pool_bytes
        else:
            taken = allocated - self.allocated_before
        _LIVE[engine] = Holding(self.model, device_key(self.device), taken)
        return taken


def free_cached(device: torch.device) -> None:
    """Frees what dropped tensors held: the garbage, then the caching allocator's blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def memory_error(
    model: str, device: torch.device, problem: str, held: list[Holding]
) -> DeviceMemoryError:
    """The error of an engine that does not fit: what it needs, and what holds the memory."""
    key = device_key(device)
    if held:
        engines = ", ".join(f"{h.model!r} holds {_gib(h.bytes)}" for h in held)
        hint = (
            f"{len(held)} other engine{'s' if len(held) > 1 else ''} of this process on {key}: "
            f"{engines}; release each with eng.close() before building the next, or build "
            f"engines in 'with Engine(...) as eng:' blocks ('eng = Engine(...)' run again "
            f"builds the new engine while the old one is still bound to eng)"
        )
    else:
        hint = (
            f"no other engine of this process holds memory on {key} (other processes may: "
            f"nvidia-smi lists them); lower max_num_batched_tokens, max_num_seqs or "
            f"max_model_len, or use a smaller model"
        )
    return DeviceMemoryError(
        f"the engine for model {model!r} does not fit on {key}: {problem}; {hint}"
    )


def what_ran_out(exc: torch.cuda.OutOfMemoryError) -> str:
    """What an engine's build ran out of: the pool's own message (``memory.num_pages``), or the
    part of CUDA's that says what it was asked for."""
    if isinstance(exc, DeviceMemoryError):
        return str(exc)
    found = re.search(r"Tried to allocate [\d.]+ [KMGT]?i?B", str(exc))
    return f"out of memory while loading it ({found.group(0) if found else exc})"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
