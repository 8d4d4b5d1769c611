"""``max_num_seqs: auto``: how many rows an engine runs at once, sized from its pool.

The cap on running rows matters beyond the pages: it sizes the sampler's temporaries, the CUDA
graphs captured (one per bucket up to it) and their shared page table. Admission stops at the
pages anyway, so a cap below what the pool holds only wastes the device (a GQA model's KV is
narrow: at 256 rows its pool is mostly empty) and a cap far above it only grows those buffers.
``auto`` takes the rows whose KV at ``auto_context_tokens`` of context (at most the model's
context) fits in the pool after the adapters a batch may pin (``max_adapters_per_batch`` of
the store's mean size: S-LoRA pages an adapter by its rank, so a batch holds the ranks its rows
bring, not the largest), between ``AUTO_MIN_SEQS`` and ``AUTO_MAX_SEQS``. The adapters hold
back at most half the pool (``PINNED_SHARE``): adapters that large (LoRA on a mixture of
experts' every expert: about 1 GB each on Qwen3-30B-A3B) cannot all be resident at once, so
the batch runs on the few that fit beside its KV, and admission, which stops at the free pages
and evicts idle adapters for KV, settles the split; planning for all of them would leave no KV.

Running example: Llama-3-8B shapes in bf16 (32 layers, 8 KV heads of 128: a page is one
layer's K or V of a token, 1024 values, 2 KiB; 64 KiB over the layers; a token's K and V 128
KiB). A 100 GiB pool holds 819200 tokens of KV; 256 pinned adapters of rank 32 on
q, k, v, o take about 13 GiB of it (rank x (4+4 + 4+1 + 4+1 + 4+4) pages a layer); the rest
holds 87 GiB / 128 KiB / 512 = 1392 rows at 512 tokens each: capped to 1024. Qwen3-30B-A3B
(48 layers, 4 KV heads of 128: 96 KiB of K and V a token) with a 14 GiB pool and 100 adapters
on the experts of ranks 8 and 16 (0.93 GiB mean): 93 GiB would be held back, leaving no KV;
at half the pool, 7 GiB holds 7 of them and 7 GiB of KV 149 rows at 512 tokens.
"""

from __future__ import annotations

import dataclasses
import logging

from slora_batch.engine.config import AUTO_MAX_SEQS, AUTO_MIN_SEQS, EngineConfig

log = logging.getLogger(__name__)

PINNED_SHARE = 0.5  # of the pool, at most, held back for the adapters a batch may pin


def auto_num_seqs(
    config: EngineConfig,
    pages: int,
    token_pages: int,
    adapter_pages: list[int],
    max_model_len: int,
    quiet: bool = False,
) -> int:
    """Rows at once for ``max_num_seqs: auto``; logs how it got there unless ``quiet``.

    ``pages``: the pool's pages (KV and adapters: unified or the sum of both pools);
    ``token_pages``: pages of one token's K and V; ``adapter_pages``: each servable adapter's
    pages (held back: as many adapters of their mean size as a batch may pin, which is at most
    ``max_adapters_per_batch``, all of them, and one a row; and at most ``PINNED_SHARE`` of the
    pool). Holding the largest instead left Llama-3-8B shapes with ranks 8-64 282 rows where
    696 fit without adapters, on an H100; a 512-row cap ran 4% faster, Llama-2-7B's 18%
    (benchmarks/README.md). Admission still stops at the free pages.
    """
    context = min(config.auto_context_tokens, max_model_len)
    count = min(len(adapter_pages), config.max_adapters_per_batch)
    mean = sum(adapter_pages) / len(adapter_pages) if adapter_pages else 0.0
    rows = _rows(pages, token_pages * context, mean, count)
    pinned = _pinned(rows, mean, count, pages)
    floor = max(AUTO_MIN_SEQS, config.admit_batch or 1)
    seats = min(AUTO_MAX_SEQS, max(floor, rows))
    if not quiet:
        log.info(
            "max_num_seqs auto: %d rows (pool %d pages, %d held for %d adapters a batch may "
            "pin, %d KV pages a row at %d tokens of context fit %d rows; bounds %d..%d)",
            seats,
            pages,
            pinned,
            min(count, rows),
            token_pages * context,
            context,
            rows,
            floor,
            AUTO_MAX_SEQS,
        )
    return seats


def _pinned(rows: int, mean: float, count: int, pages: int) -> int:
    """Pages held back for the adapters ``rows`` rows may pin: one a row, at most ``count``, of
    ``mean`` pages each, at most ``PINNED_SHARE`` of the pool."""
    return min(-int(-min(rows, count) * mean // 1), int(pages * PINNED_SHARE))


def _rows(pages: int, row_pages: int, mean: float, count: int) -> int:
    """The most rows whose KV (``row_pages`` each) fits beside the adapters they may pin
    (``_pinned``, which grows with the rows, so a binary search finds the last that fits)."""
    lo, hi = 0, pages // row_pages
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * row_pages + _pinned(mid, mean, count, pages) <= pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


def resolved(config: EngineConfig, seats: int) -> EngineConfig:
    """``config`` with ``max_num_seqs`` set (an ``auto`` one resolved to ``seats``)."""
    if config.max_num_seqs != "auto":
        return config
    return dataclasses.replace(config, max_num_seqs=seats)
