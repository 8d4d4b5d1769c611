"""Prefix caching in the unified pool: the KV pages of full blocks of prompt tokens, kept after
their rows finish and shared by later rows with the same prefix on the same adapter.

A block is ``block_tokens`` consecutive prompt tokens starting at a multiple of it. Its key
chains the key of the block before it, the adapter and the block's tokens, so one key names a
whole prefix: an adapter's KV differs from the base model's and from every other adapter's, and
rows share only with rows of the same adapter (base-model rows with base-model rows).

A sequence holds references to the blocks of its prefix, in order (``Sequence.blocks``): the
ones it found on admission and the ones it computed itself, which join the cache when the step
that computes them is launched (a later step, on the same stream, reads them after they are
written). A block nobody references stays in the pool, idle, until its pages are needed; then
``AdapterResidency.make_room`` takes the least recently used of the idle blocks and the idle
adapters, one at a time (a block only once no cached block extends it: leaves first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from slora_batch.engine.pool import PagePool


@dataclass(eq=False)
class Block:
    key: int
    parent: Block | None
    adapter: str | None
    tokens: tuple[int, ...]  # checked on a hit: a hash collision is a miss, never a wrong KV
    pages: np.ndarray  # [block_tokens, 2] (K page, V page) per token
    refs: int = 0
    children: int = 0  # cached blocks that extend this one
    last_used: int = 0

    def same(self, parent: Block | None, adapter: str | None, tokens: tuple[int, ...]) -> bool:
        return self.parent is parent and self.adapter == adapter and self.tokens == tokens


def chain_key(parent: Block | None, adapter: str | None, tokens: tuple[int, ...]) -> int:
    """A block's key: the key of the block before it (None for a prompt's first block), the
    adapter and the block's own tokens, so one key names a whole prefix under one adapter."""
    return hash((parent.key if parent is not None else None, adapter, tokens))


class PrefixCache:
    def __init__(self, pool: PagePool, block_tokens: int) -> None:
        self.pool = pool
        self.block_tokens = block_tokens
        self.blocks: dict[int, Block] = {}
        self.idle: OrderedDict[int, Block] = OrderedDict()  # refs 0, least recently used first
        self.clock = 0  # advanced by the scheduler every step: the LRU's time
        self.hit_tokens = 0
        self.inserted = 0
        self.evictions = 0
        self.idle_pages = 0  # pages of the idle blocks, kept as they come and go

    def match(self, adapter: str | None, tokens: list[int]) -> list[Block]:
        """The cached blocks of the longest cached prefix of ``tokens``, at most every full
        block before the last token (whose logits a row needs computed)."""
        size = self.block_tokens
        found: list[Block] = []
        parent = None
        for start in range(0, len(tokens) - size, size):
            chunk = tuple(tokens[start : start + size])
            block = self.blocks.get(chain_key(parent, adapter, chunk))
            if block is None or not block.same(parent, adapter, chunk):
                break
            found.append(block)
            parent = block
        return found

    def acquire(self, blocks: list[Block]) -> None:
        per_block = self.block_tokens * self.pool.kv_pages_per_token  # a block's own pages
        for block in blocks:
            if block.refs == 0:
                del self.idle[block.key]
                self.idle_pages -= per_block
            block.refs += 1
        self.hit_tokens += len(blocks) * self.block_tokens

    def release(self, blocks: list[Block]) -> None:
        per_block = self.block_tokens * self.pool.kv_pages_per_token  # a block's own pages
        for block in blocks:
            block.refs -= 1
            assert block.refs >= 0, "a cached block released more often than acquired"
            if block.refs == 0:
                block.last_used = self.clock
                self.idle[block.key] = block
                self.idle_pages += per_block

    def insert(
        self, parent: Block | None, adapter: str | None, tokens: list[int], pages: np.ndarray
    ) -> Block | None:
        """Caches a block a sequence just computed (the sequence holds the reference); None
        when another sequence cached the same block first (its own pages stay its own)."""
        tokens = tuple(tokens)
        key = chain_key(parent, adapter, tokens)
        if key in self.blocks:
            return None
        block = Block(key, parent, adapter, tokens, pages.copy(), refs=1)
        self.blocks[key] = block
        if parent is not None:
            parent.children += 1
        self.inserted += 1
        return block

    def oldest_idle(self) -> Block | None:
        """The least recently used idle block that no cached block extends."""
        for block in self.idle.values():
            if block.children == 0:
                return block
        return None

    def evict(self, block: Block, free: bool = True) -> np.ndarray:
        """Drops an idle block and returns its pool pages, given back to the pool unless
        ``free`` is False (the caller frees many blocks' pages in one ``PagePool.free``)."""
        pages = self.pool.own_pages(block.pages)
        del self.idle[block.key]
        self.idle_pages -= pages.size
        del self.blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        if free:
            self.pool.free(pages)
        self.evictions += 1
        return pages

    def clear(self) -> None:
        """Frees every idle block (at the end of a stream nothing references any)."""
        pages = []
        while self.idle:
            block = self.oldest_idle()
            if block is None:
                break
            pages.append(self.evict(block, free=False))
        if pages:
            self.pool.free(np.concatenate(pages))
