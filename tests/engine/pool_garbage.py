"""Garbage in the free pages of an fp8 KV engine's pool, for tests/engine/test_fp8_kv.py.

A new pool holds zeros and its fp8 scale table ones, so in a fresh run a read of bytes nobody
wrote for the sequence finds zeros, or the stale bytes of a freed page: an adapter's weights or
an older sequence's KV now used as an fp8 KV page, or the scale row of a page that held adapter
weights (adapter loads write no scales). ``poison`` fills every free page of a just built engine,
K/V bytes, tails and scale rows alike, with e4m3 NaN (bytes 0xff, NaN scales) or huge finite
values (bytes 0x7e = 448, scales 1e30): a read of such bytes turns the logprobs NaN or moves
them, so an engine that reads only what it wrote gives the clean run's tokens and logprobs bit
for bit. ``PageLog`` records who took each page, so a test can check that the filled pages
were really handed out: to adapters, then as KV pages, and as KV pages more than once.

As a script (``python -m pool_garbage SPEC``) it runs the clean and the poisoned engine on the
Triton kernels and prints both outcomes as JSON: the interpreter child of
``test_fp8_triton_kernels_read_no_garbage`` (TRITON_INTERPRET=1 has to be set before the
kernels are imported, for the whole process).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np
import torch

from slora_batch import Engine, EngineConfig, Request

GARBAGE = {  # name: (every byte of a free page, every entry of its rows of the scale table)
    "nan": (0xFF, float("nan")),  # e4m3 0xff (and 0x7f) is NaN; fp32 0xffffffff and fp16 too
    "huge": (0x7E, 1e30),  # e4m3 448, its largest finite value; fp32 8.4e37, fp16 NaN
}


class PageLog:
    """Who took each page of ``pool``, in order: "kv" (``PagePool.kv_pages``) or "adapter"."""

    def __init__(self, pool) -> None:
        self.takes: dict[int, list[str]] = defaultdict(list)
        alloc = pool.alloc

        def logged(n: int, what: str = "") -> np.ndarray:
            pages = alloc(n, what)
            kind = "kv" if not what else "adapter" if what.startswith("adapter") else what
            for page in pages.tolist():
                self.takes[page].append(kind)
            return pages

        pool.alloc = logged  # kv_pages calls self.alloc: this one

    def stats(self, filled: np.ndarray) -> dict[str, int]:
        """Filled pages handed out as KV, as KV after being an adapter's, and as KV twice."""
        takes = [self.takes.get(page, []) for page in filled.tolist()]
        return dict(
            filled=len(takes),
            kv=sum("kv" in t for t in takes),
            kv_after_adapter=sum("adapter" in t and "kv" in t[t.index("adapter") :] for t in takes),
            kv_twice=sum(t.count("kv") >= 2 for t in takes),
        )


def poison(pool, kinds: tuple[str, ...]) -> np.ndarray:
    """Fills every free page of ``pool`` (all layers) and its scale rows with ``GARBAGE``, the
    kinds taking turns page by page; returns the pages filled (none when ``kinds`` is empty)."""
    if not kinds:
        return np.zeros(0, dtype=np.int32)
    free = pool.free_pages()
    data = pool.data.view(torch.uint8).view(pool.data.shape[0], pool.num_pages, -1)
    for i, kind in enumerate(kinds):
        byte, scale = GARBAGE[kind]
        pages = torch.from_numpy(free[i :: len(kinds)]).long()
        data[:, pages] = byte
        pool.scales[:, pages] = scale
    return free


def run(model_dir, adapters, rows, kinds: tuple[str, ...] = (), **knobs):
    """(outcome, engine, page stats) of an fp8 KV engine on the CPU over ``rows``, its free pages
    poisoned with ``kinds`` right after it is built. Every adapter is read into host memory
    first: admission prefers rows whose adapter the loader thread has read already
    (``Scheduler._pick``), so otherwise the steps, and the last bits of the logprobs, would
    depend on that thread's timing from run to run."""
    config = EngineConfig(device="cpu", kv_cache_dtype="fp8", **knobs)
    engine = Engine(model_dir, adapters=adapters, config=config)
    for name in engine.store.names:
        engine.store.paged(name)
    filled = poison(engine.pool, kinds)
    # Page 0 kept out of use, poisoned too, as a resident adapter's page would be: the twins'
    # decode reads it for the keys past a sequence's length (ref.attention_decode clamps the
    # table's -1 to 0), and adapter loads write no scale rows.
    assert engine.pool.alloc(1, "held").tolist() == [0]
    log = PageLog(engine.pool)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    assert len(results) == len(rows)
    counters = engine.counters
    stats = dict(log.stats(filled), preemptions=counters.preemptions,
                 prefix_hit_tokens=counters.prefix_hit_tokens,
                 evictions=engine.residency.evictions, ops=engine.ops.__name__)  # fmt: skip
    return outcome(results), engine, stats


def outcome(results: dict) -> dict[str, list]:
    """Per row id (as a string): its tokens, scored logprobs and top-logprob records."""
    return {str(key): [r.token_ids, r.token_logprobs, r.logprobs] for key, r in results.items()}


def logprob_values(out: dict[str, list]) -> list[float]:
    values = []
    for _, scored, records in out.values():
        values += scored or []
        for record in records or []:
            values += [record["logprob"]] + [top["logprob"] for top in record.get("top", [])]
    return values


def main(spec: dict) -> None:
    """The clean and the poisoned engine on ``spec``'s rows, both outcomes printed as JSON."""
    report = {}
    for name, kinds in (("clean", ()), ("poisoned", tuple(spec["kinds"]))):
        out, _, stats = run(spec["model"], spec["adapters"], spec["rows"], kinds, **spec["knobs"])
        report[name] = dict(outcome=out, stats=stats)
    print(json.dumps(report))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
