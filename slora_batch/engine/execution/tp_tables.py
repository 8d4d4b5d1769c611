"""Tensor parallelism's page tables on their way from rank 0 to the other ranks: only the
entries each sequence added since it was last sent (``tp`` says where they travel)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np


class PageTableSender:
    """Rank 0's side of the page tables: instead of a step's whole table ([rows, context, 2]:
    megabytes at long contexts), the entries each sequence added since it was last sent, by the
    sequence's key (``HostStep.seq_keys``: a preempted sequence gets a new one). A key unseen
    for ``FORGET_STEPS`` steps is dropped on both sides (sent again whole if it comes back)."""

    FORGET_STEPS = 64

    def __init__(self) -> None:
        self.sent: dict[tuple, int] = {}  # key -> table entries the other ranks hold
        self.seen: dict[tuple, int] = {}  # key -> the step it was last in
        self.steps = 0

    def encode(self, host) -> tuple:
        """(host without its page table, table width, [(key, start, new entries)], dropped)."""
        self.steps += 1
        rows = []
        for b, key in enumerate(host.seq_keys):
            length, start = int(host.b_seq_len[b]), self.sent.get(key, 0)
            if length > start:
                rows.append((key, start, host.page_table[b, start:length].copy()))
                self.sent[key] = length
            self.seen[key] = self.steps
        dropped = [k for k, step in self.seen.items() if step < self.steps - self.FORGET_STEPS]
        for key in dropped:
            del self.seen[key], self.sent[key]
        return replace(host, page_table=None), host.page_table.shape[1], rows, dropped


class PageTableReceiver:
    """A worker rank's side: each key's entries, grown as they come; the step's table rebuilt."""

    def __init__(self) -> None:
        self.tables: dict[tuple, np.ndarray] = {}

    def decode(self, host, width: int, rows: list, dropped: list):
        for key in dropped:
            self.tables.pop(key, None)
        for key, start, entries in rows:
            table = self.tables.get(key)
            end = start + entries.shape[0]
            if table is None or start == 0:
                table = np.empty((max(end, 16), 2), dtype=np.int32)
            elif end > table.shape[0]:
                grown = np.empty((max(end, 2 * table.shape[0]), 2), dtype=np.int32)
                grown[:start] = table[:start]
                table = grown
            table[start:end] = entries
            self.tables[key] = table
        page_table = np.full((len(host.seq_keys), width, 2), -1, dtype=np.int32)
        for b, key in enumerate(host.seq_keys):
            length = int(host.b_seq_len[b])
            page_table[b, :length] = self.tables[key][:length]
        return replace(host, page_table=page_table)
