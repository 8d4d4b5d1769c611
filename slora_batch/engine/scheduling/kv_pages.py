"""The pages of sequences: KV pages from the pool, cached prefix blocks shared between rows,
and the room a new row needs, counting what can be evicted. ``Scheduler`` decides who runs;
this decides whether the pages are there and hands them out.

A sequence's pages (``Sequence.pages``, one (K, V) pair per token) start with the pages of the
cached blocks it references (``Sequence.blocks``), then its own. Under unified paging the KV
pool is also the adapters' pool, so an idle adapter's pages and an idle cached block's pages
are room alike (``AdapterResidency.make_room`` evicts both, least recently used first).
"""

from __future__ import annotations

import numpy as np

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.pool import PagePool
from slora_batch.engine.requests.sequence import Sequence
from slora_batch.engine.scheduling.prefix_cache import Block, PrefixCache, chain_key
from slora_batch.engine.scheduling.rows import RowTable

PAGES_PER_TOKEN = 2  # one K page and one V page (``PagePool.kv_pages_per_token``: 1 with fp8)


class KVPages:
    def __init__(
        self,
        pool: PagePool,
        residency: AdapterResidency,
        cache: PrefixCache | None,
        long_prompts: int | None = None,
    ):
        self.pool, self.residency, self.cache = pool, residency, cache
        # longrope: prompts longer than this compute every position with the long factors, so
        # their cached blocks are shared only among themselves (``space``).
        self.long_prompts = long_prompts
        self.block_tokens = cache.block_tokens if cache is not None else 0
        residency.cache = cache  # its make_room evicts idle blocks and adapters alike

    def never_fits(self, seq: Sequence) -> str | None:
        """Why a sequence could never run, even alone: its whole context's KV pages and its
        adapter's pages against the pools that hold them (one pool for both when unified)."""
        kv = self.pool.kv_pages_per_token * self.pool.kv_slots(
            len(seq.prompt_ids) + seq.max_new_tokens
        )
        adapter = self.residency.footprint(seq.adapter) if seq.adapter else 0
        for pool, need in self.by_pool(kv, adapter).values():
            if need > pool.num_pages:
                return (
                    f"needs {need} pages (prompt {len(seq.prompt_ids)} + {seq.max_new_tokens} "
                    f"new tokens: {kv} KV pages, adapter {adapter}), the pool has {pool.num_pages}"
                )
        return None

    def by_pool(self, kv: int, adapter: int) -> dict[int, tuple[PagePool, int]]:
        """Pages wanted per pool: KV pages from the KV pool, adapter pages from the adapters'
        pool, summed when they are one pool (S-LoRA's unified paging)."""
        demand = {id(self.pool): (self.pool, kv)}
        lora_pool = self.residency.pool
        _, have = demand.get(id(lora_pool), (lora_pool, 0))
        demand[id(lora_pool)] = (lora_pool, have + adapter)
        return demand

    @staticmethod
    def matchable(seq: Sequence) -> list[int]:
        """The tokens a sequence may take from the cache, all but the last of which it may
        skip: a generated row's prompt; a scored row's context alone, since the context's last
        token predicts the first continuation token and every continuation token is scored.
        Running example, blocks of 4: context [c0..c13], continuation [x0, x1, x2]; the
        cache may hold [c12, c13, x0, x1] (another choice starting x0, x1), but the row matches
        only blocks before c13 (c0..c11) and computes from c12, scoring from c13 on."""
        return seq.prompt_ids if seq.draws else seq.prompt_ids[: seq.scores.start]

    def prefix(self, seq: Sequence) -> list[Block]:
        """The cached blocks a waiting sequence's prompt starts with (none for a sequence
        whose KV is partly computed), within ``matchable``."""
        if self.cache is None or seq.num_computed:
            return []
        return self.cache.match(self.space(seq), self.matchable(seq))

    def space(self, seq: Sequence) -> str | None:
        """The prefix cache's namespace of a sequence: its adapter (None: the base model),
        apart for longrope prompts past the original context (their K differ at every
        position)."""
        if self.long_prompts is not None and len(seq.prompt_ids) > self.long_prompts:
            return f"{seq.adapter}\x00longrope"
        return seq.adapter

    def first_miss(self, seq: Sequence, hit: list[Block]) -> int | None:
        """The key of the block a sequence computes first past its cached prefix ``hit``
        (None when no full block of ``matchable`` is left before its last token: a block it
        could not take from the cache is not worth waiting for)."""
        if self.cache is None:
            return None
        tokens = self.matchable(seq)
        size = self.block_tokens
        lo = len(hit) * size
        if lo + size >= len(tokens):
            return None
        parent = hit[-1] if hit else None
        return chain_key(parent, self.space(seq), tuple(tokens[lo : lo + size]))

    def admissible(self, seq: Sequence, n: int, hit: list[Block], pinned: bool) -> bool:
        """Whether a waiting sequence fits: ``n`` tokens of KV past its cached prefix ``hit``,
        and its adapter's pages unless resident. Idle adapters (in the adapters' pool) and idle
        cached blocks (in the KV pool) count as room, less what this admission pins: its
        adapter unless ``pinned`` already, and the idle blocks of its hit."""
        adapter = seq.adapter
        evictable = self.residency.evictable_pages()
        if adapter and self.residency.is_resident(adapter) and not pinned:
            evictable -= self.residency.store.pages(adapter)
        cached = 0
        if self.cache is not None:
            cached = self.cache.idle_pages - sum(
                self.pool.own_pages(b.pages).size for b in hit if b.refs == 0
            )
        # Room per pool, keyed by the pool object: under unified paging the KV pool and the
        # adapters' pool are one object, so free pages, idle blocks and idle adapters add into
        # one entry; with two pools (the bench's ablation) each counts only its own.
        room = {id(self.pool): self.pool.num_free + cached}
        lora_pool = self.residency.pool
        room[id(lora_pool)] = room.get(id(lora_pool), lora_pool.num_free) + evictable
        demand = self.by_pool(self.kv_need(seq, n), self.residency.cost(adapter))
        return all(want <= room[key] for key, (_, want) in demand.items())

    def kv_need(self, seq: Sequence, n: int) -> int:
        """KV pages a sequence's next ``n`` tokens take beyond the token slots it holds (slots
        come in whole groups of positions with fp8 KV, ``PagePool.kv_slots``)."""
        have = seq.pages.shape[0]
        slots = self.pool.kv_slots(seq.num_computed + n) - have
        return self.pool.kv_pages_per_token * max(slots, 0)

    def attach(self, seq: Sequence, hit: list[Block]) -> None:
        """The cached prefix becomes the sequence's first pages, its KV computed."""
        if hit:
            self.cache.acquire(hit)
            seq.blocks = list(hit)
            seq.add_pages(np.concatenate([block.pages for block in hit]))
            seq.num_computed = len(hit) * self.block_tokens

    def room(self, need: int) -> bool:
        """Whether ``need`` KV pages are free, evicting idle blocks and idle adapters (which
        frees KV pages only where they share the pool)."""
        return self.residency.make_room(need, self.pool)

    def take(self, seq: Sequence, n: int) -> None:
        """Pages for a sequence's next ``n`` tokens (those it lacks, in whole groups)."""
        slots = self.pool.kv_slots(seq.num_computed + n) - seq.pages.shape[0]
        if slots > 0:
            seq.add_pages(self.pool.kv_pages(slots))

    def take_one_each(self, seqs: list[Sequence], table: RowTable, whole: bool = False) -> bool:
        """Page pairs for the next token of each sequence that lacks one (a group's slots with
        fp8 KV), in one ``alloc``,
        written into the sequences' rows of ``table`` (running sequences: all seated; ``whole``:
        ``seqs`` are the table's rows in order); False (nothing taken) when the pool has no room
        for all of them."""
        if whole:
            rows = np.arange(len(seqs), dtype=np.int64)
        else:
            rows = np.array([s.row for s in seqs], dtype=np.int64)
        short = rows[table.b_computed[rows] + 1 > table.b_paged[rows]]
        group = self.pool.group  # slots a row lacking one takes: a whole group of them
        if not self.room(self.pool.kv_pages_per_token * group * short.size):
            return False
        if short.size:
            pairs = self.pool.kv_pages(group * short.size).reshape(short.size, group, 2)
            table.add_each(short, pairs)
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """Caches the full prompt blocks a sequence has computed and not cached yet."""
        size = self.block_tokens
        while len(seq.blocks) < min(seq.num_computed, len(seq.prompt_ids)) // size:
            lo = len(seq.blocks) * size
            parent = seq.blocks[-1] if seq.blocks else None
            tokens = seq.prompt_ids[lo : lo + size]
            block = self.cache.insert(parent, self.space(seq), tokens, seq.pages[lo : lo + size])
            if block is None:  # cached by another sequence first: the rest stays its own
                seq.cache_done = True
                return
            seq.blocks.append(block)

    def free(self, seqs: list[Sequence]) -> None:
        """The sequences' own pages go back to the pool in one ``PagePool.free``; their cached
        blocks stay, one reference fewer (idempotent). The same pages, references and free-list
        order as freeing them one by one in this order: the pool pushes a freed array reversed,
        so the arrays go in last first. Running example: own pages a = [1, 2], b = [3, 4]
        freed one by one push [2, 1] then [4, 3]; here ``free([3, 4, 1, 2])`` pushes [2, 1, 4, 3]."""
        own = []
        for seq in seqs:
            pages = seq.drop_pages()
            if seq.blocks:
                self.cache.release(seq.blocks)
                pages = pages[len(seq.blocks) * self.block_tokens :]
                seq.blocks = []
            seq.cache_done = False
            own.append(self.pool.own_pages(pages))
        if len(own) == 1:
            self.pool.free(own[0])
        elif own:
            self.pool.free(np.concatenate(own[::-1]))
