"""Bounded windows sorted by (adapter, prompt length), and fan-out for evaluation sweeps.

Sorting the whole input would need it all in memory; sorting ``window`` rows at a time keeps
memory bounded and still hands the engine runs of rows that share an adapter and have similar
lengths. Every item comes out exactly once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

from slora_batch.request import Request, Result

T = TypeVar("T")


def sort_key(item: Request | Result) -> tuple[int, int, str, int]:
    """Error results first (they skip the engine), then base-model rows, then by adapter name and
    prompt length in characters (a cheap proxy for tokens).

    Running example: [Request(adapter="b", prompt="xx"), Result(error), Request(adapter=None,
    prompt="xyz"), Request(adapter="a", prompt="x")] sorts to Result, None/"xyz", "a"/"x", "b"/"xx".
    """
    if isinstance(item, Result):
        return (0, 0, "", 0)
    adapter = item.adapter or None
    return (1, 0 if adapter is None else 1, adapter or "", prompt_length(item))


def prompt_length(request: Request) -> int:
    if request.prompt is not None:
        return len(request.prompt)
    if request.messages is not None:
        return sum(len(message.get("content") or "") for message in request.messages)
    return len(request.prompt_token_ids or ())


def sorted_windows(
    items: Iterable[T], window: int, key: Callable[[T], Any] = sort_key
) -> Iterator[T]:
    """Pull up to ``window`` items, yield them sorted by ``key`` (stable), repeat until exhausted.

    Memory holds at most one window of items.
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    iterator = iter(items)
    while chunk := list(islice(iterator, window)):
        chunk.sort(key=key)
        yield from chunk


def fan_out(
    items: Iterable[Request | Result], adapters: Sequence[str | None]
) -> Iterator[Request | Result]:
    """Yield each item once per adapter in ``adapters`` (None = base model), with ``adapter`` set.

    Error results fan out too, so that every (id, adapter) resume key gets an output row.
    The rows' own ``adapter`` values are replaced.
    """
    if not adapters:
        raise ValueError("fan_out needs at least one adapter (None = base model)")
    for item in items:
        for adapter in adapters:
            yield dataclasses.replace(item, adapter=adapter or None)
