"""Bounded windows sorted by (adapter, prompt), and fan-out for evaluation sweeps.

Sorting the whole input would need it all in memory; sorting ``window`` rows at a time keeps
memory bounded and still hands the engine runs of rows that share an adapter, and within an
adapter, rows in prompt order, so that rows with a shared prefix (a system prompt, few-shot
examples) run close in time and find its blocks in the prefix cache. Every item comes out
exactly once.

Windows alternate their adapter order (a..z, then z..a, ...). With the same order in every
window, adapter access is cyclic: a cache of adapters smaller than a window's set (the host
cache, the device's slots) holds none of the next window's first adapters, and hits ~0%. With
alternating order, each window starts with the adapters the previous one ended with, which are
still cached.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

from slora_batch.engine.requests.request import Request, Result

T = TypeVar("T")


def sort_key(item: Request | Result) -> tuple:
    """Error results first (they skip the engine), then base-model rows, then by adapter name
    and prompt (``prompt_order``: rows sharing a prefix become neighbours).

    Running example: [Request(adapter="b", prompt="xx"), Result(error), Request(adapter=None,
    prompt="xyz"), Request(adapter="a", prompt="x")] sorts to Result, None/"xyz", "a"/"x", "b"/"xx".
    """
    if isinstance(item, Result):
        return (0, 0, "", (0, ""))
    adapter = item.adapter or None
    return (1, 0 if adapter is None else 1, adapter or "", prompt_order(item))


def prompt_order(request: Request) -> tuple[int, Any]:
    """A request's prompt as a sort key: its text (chat turns joined role by role), or its token
    ids; text rows before token rows, so the two never compare. Example: "Translate: cat" and
    "Translate: dog" sort next to each other, before "Write ..."."""
    if request.prompt is not None:
        return (0, str(request.prompt))
    if request.messages is not None:
        turns = (f"{m.get('role')}\x00{m.get('content') or ''}" for m in request.messages)
        return (0, "\x01".join(turns))
    return (1, tuple(request.prompt_token_ids or ()))


def adapter_group(item: Request | Result) -> tuple[int, str | None]:
    """The run an item belongs to in a sorted window: error results (first in every window),
    or the rows of one adapter (None = base model)."""
    return (0, None) if isinstance(item, Result) else (1, item.adapter or None)


def sorted_windows(
    items: Iterable[T],
    window: int,
    key: Callable[[T], Any] = sort_key,
    group: Callable[[T], Any] | None = adapter_group,
) -> Iterator[T]:
    """Pull up to ``window`` items, yield them sorted by ``key`` (stable), repeat until exhausted.
    In every second window the runs of equal ``group`` after the first run come in reverse
    order (see the module docstring); ``group`` None keeps every window in ``key`` order.

    Running example (window 4, key adapter): [b, a, c, a | c, b, a, c] comes out as
    [a, a, b, c | c, c, b, a]. Memory holds at most one window of items.
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    iterator = iter(items)
    for index in itertools.count():
        chunk = list(islice(iterator, window))
        if not chunk:
            return
        chunk.sort(key=key)
        if index % 2 and group is not None:
            chunk = _reverse_runs(chunk, group)
        yield from chunk


def _reverse_runs(chunk: list[T], group: Callable[[T], Any]) -> list[T]:
    """The runs of equal ``group`` in reverse order, except the first run when it is the error
    results' (they always lead: they skip the engine)."""
    runs = [list(run) for _, run in itertools.groupby(chunk, key=group)]
    head = [runs.pop(0)] if runs and group(runs[0][0]) == (0, None) else []
    return [item for run in head + runs[::-1] for item in run]


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
