"""Adapters move ahead of the rows that need them: disk -> host on the store's loader thread,
host -> device pool pages on a side CUDA stream.

``load_ahead`` runs before each step is scheduled: the next waiting rows' adapters are queued on
the loader thread, so that admission never reads a file. ``prefetch`` runs once a step's tokens
are read back (pages free then are used by no step in flight): the adapters of the next two
admission groups are copied into free pages, idle and unpinned, so that a group that joins the
batch finds them resident. ``order`` makes the device stream wait for those copies before the
next step reads the pool.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.adapters.store import AdapterStore

if TYPE_CHECKING:  # the engine hands in its scheduler; the prefetcher reads its waiting queue
    from slora_batch.engine.scheduling.scheduler import Scheduler

LOAD_AHEAD_ADAPTERS = 32  # distinct adapters of the next waiting rows the loader reads ahead
LOAD_AHEAD_SCAN = 512  # waiting rows looked at for them


class AdapterPrefetcher:
    def __init__(
        self,
        scheduler: Scheduler,
        residency: AdapterResidency,
        store: AdapterStore,
        stream: torch.cuda.Stream | None,
        admit_seats: int,
    ) -> None:
        self.scheduler, self.residency, self.store = scheduler, residency, store
        self.stream = stream  # None: no device prefetch (CPU, or switched off)
        self.adapters = max(8, 2 * admit_seats)
        self._copied: torch.cuda.Event | None = None  # the latest copies' end, not waited yet

    def load_ahead(self) -> None:
        """Queue the reads of the next waiting rows' adapters on the loader thread, up to
        ``LOAD_AHEAD_ADAPTERS`` distinct ones and the store's byte budget."""
        seen: set[str] = set()
        for seq in itertools.islice(self.scheduler.waiting, LOAD_AHEAD_SCAN):
            if seq.adapter and seq.adapter not in seen:
                if len(seen) == LOAD_AHEAD_ADAPTERS or not self.store.load_ahead(seq.adapter):
                    return
                seen.add(seq.adapter)

    def prefetch(self) -> None:
        """Copy the adapters of the next waiting rows (two admission groups' worth, at least 8
        distinct) into free pool pages on the side stream."""
        if self.stream is None:
            return
        loaded: list[str] = []
        seen: set[str] = set()
        for seq in self.scheduler.waiting:
            if len(seen) >= self.adapters:
                break
            if seq.adapter and seq.adapter not in seen:
                seen.add(seq.adapter)
                if self.residency.prefetch(seq.adapter, self.stream):
                    loaded.append(seq.adapter)
        if loaded:
            event = self.stream.record_event()
            self.residency.mark_copying(loaded, event)  # an eviction of one waits for it
            self._copied = event

    def order(self, device: torch.device) -> None:
        """Make the device stream wait for the copies issued so far (before a step runs)."""
        if self._copied is not None:
            torch.cuda.current_stream(device).wait_event(self._copied)
            self._copied = None
