"""The engines alive in this process, per device, and the memory each holds: a new engine that
does not fit beside them fails before it allocates, with a message that names them.

The case it is for: a notebook cell ``eng = Engine(...)`` run again builds the new engine
while the old one is still bound to ``eng``, so the new one gets what the old one left (its
pool is sized from free memory) or, for a larger model, CUDA's out-of-memory error from deep
inside. Engines are held by weak references: one that is dropped (or closed) leaves at once.
"""

from __future__ import annotations

import gc
import re
import weakref
from dataclasses import dataclass

import torch

from slora_batch.engine.execution import memory
from slora_batch.engine.execution.memory import GIB, DeviceMemoryError


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


def hold(engine: object, holding: Holding) -> None:
    _LIVE[engine] = holding


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


def check_room(model: str, device: torch.device, weights: int, rest: int) -> list[Holding]:
    """Raises ``DeviceMemoryError`` when an engine that takes at least ``weights`` + ``rest``
    bytes (``memory.min_engine_bytes``) does not fit in what ``device`` has free; returns the
    other engines of this process on it."""
    held = holders(device)
    report = memory.device_memory(device)
    if report is not None and weights + rest > report[0]:
        free, total = report
        raise memory_error(
            model,
            device,
            f"it needs at least {_gib(weights + rest)} (weights {_gib(weights)}, pool and one "
            f"step's activations {_gib(rest)}) and {_gib(free)} of {_gib(total)} are free",
            held,
        )
    return held


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
