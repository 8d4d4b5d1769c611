"""The unified page pool: one tensor, one free list, for KV cache and adapter weights alike.

A page is one vector of ``page_size`` elements in every layer: ``data[layer, page]``. A token's K
and V take one page each; an adapter of rank r takes r rows per factor and target, each row
ceil(width / page_size) pages, so its cost grows with r and never with another adapter's rank.

With an fp8 KV cache (``use_fp8_kv``) a token's K and V share one page in e4m3 (``slora_kernels.fp8``),
its page-table row names that page twice, and a side table holds the per token and head scales:
KV pages per token drop from 2 to 1 while adapter pages stay as they are. The pages then go out
in aligned groups of ``slora_kernels.fp8.KV_GROUP`` (16): a sequence's KV takes whole groups,
position p on slot p % 16 of its group, so the V of 16 consecutive positions can be stored
column-major inside their group (the layout the decode kernel reads fastest); an adapter's pages
are whole groups too, its last one partly used (at most 15 pages more than its rows need).
"""

from __future__ import annotations

import numpy as np
import torch

from slora_kernels.fp8 import KV_GROUP


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on the CPU from memory the OS hands out zeroed on first touch (numpy's
    calloc), so a pool of gigabytes costs only the pages a run writes, not a memset of all."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class PoolExhausted(RuntimeError):
    """Not enough free pages; carries the numbers."""

    def __init__(self, need: int, free: int, total: int, what: str = "") -> None:
        self.need, self.free, self.total = need, free, total
        suffix = f" for {what}" if what else ""
        super().__init__(f"page pool exhausted{suffix}: need {need} pages, {free} free of {total}")


class PagePool:
    """Bookkeeping of the pages (host side) plus the device tensor that holds them.

    The free list is a stack of page ids in a numpy array: ``alloc(n)`` pops n ids in O(1)
    Python calls, ``free(ids)`` pushes them back. With groups (``group`` > 1, set by
    ``use_fp8_kv``) the stack holds group ids: ``alloc(n)`` takes ceil(n / group) groups and
    hands out their first n pages, and a group returns to the stack once every page handed out
    of it is freed (``_held`` counts them).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Reversed so that pages come out in ascending order at first (easier to read in tests).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages
        self._used = np.zeros(num_pages, dtype=bool)
        # ``free``'s duplicate check without a sort: page -> the index it had in the last freed
        # array. Running example: free [7, 9, 7] writes 0, 1, 2 at 7, 9, 7; page 7 then reads 2
        # where index 0 expects 0: a duplicate.
        self._last_index = np.zeros(num_pages, dtype=np.int64)
        self.peak_used = 0
        self.data = zeros((num_layers, num_pages, page_size), dtype, torch.device(device))
        # KV pages per token: a K page and a V page, or (fp8) one page holding both
        self.kv_pages_per_token = 2
        self.scales: torch.Tensor | None = None  # fp8: [num_layers, num_pages, 2 * kv_heads] fp32
        self.group = 1  # pages an allocation takes at a time, aligned (fp8 KV: KV_GROUP)
        self._held = np.zeros(0, dtype=np.int64)  # groups: pages handed out and not yet freed

    def use_fp8_kv(self, kv_heads: int, kv_dim: int) -> None:
        """KV in e4m3, one page per token, with its scale table (``slora_kernels.fp8``)."""
        page_bytes = self.page_size * self.data.element_size()
        if page_bytes < 2 * kv_dim:
            raise ValueError(
                f"an fp8 KV page holds K and V: {2 * kv_dim} bytes, pages have {page_bytes}"
            )
        self.kv_pages_per_token = 1
        if kv_dim % KV_GROUP == 0 and page_bytes % KV_GROUP == 0:  # else V stays per token
            self._use_groups(KV_GROUP)
        self.scales = torch.ones(
            self.data.shape[0],
            self.num_pages,
            2 * kv_heads,
            dtype=torch.float32,
            device=self.data.device,
        )

    def _use_groups(self, group: int) -> None:
        """Allocations in aligned groups of ``group`` pages from now on (an unused pool)."""
        assert self.num_used == 0, "groups are set before the first allocation"
        groups = self.num_pages // group
        if groups < 1:
            raise ValueError(f"a pool of {self.num_pages} pages holds no group of {group}")
        self.group = group
        self._stack = np.arange(groups - 1, -1, -1, dtype=np.int32)
        self._top = groups
        self._held = np.zeros(groups, dtype=np.int64)

    def footprint(self, pages: int) -> int:
        """Pages an allocation of ``pages`` takes from the free count: whole groups."""
        return -(-pages // self.group) * self.group

    def kv_slots(self, tokens: int) -> int:
        """Token slots a sequence holds for ``tokens`` tokens: whole groups of positions."""
        return -(-tokens // self.group) * self.group

    def kv_pages(self, n: int) -> np.ndarray:
        """KV pages for ``n`` tokens: [n, 2] (K page, V page); with fp8 both name one page,
        and n is a whole number of groups (``kv_slots``), each on its own aligned pages."""
        assert n % self.group == 0, f"{n} token slots: whole groups of {self.group}"
        pages = self.alloc(self.kv_pages_per_token * n).reshape(n, self.kv_pages_per_token)
        return pages if self.kv_pages_per_token == 2 else np.repeat(pages, 2, axis=1)

    def own_pages(self, pairs: np.ndarray) -> np.ndarray:
        """The distinct pool pages of (K page, V page) rows [n, 2], flat, for ``free``."""
        return pairs[:, : self.kv_pages_per_token].reshape(-1)

    def kv_args(self, index: int) -> dict:
        """Keywords of the KV kernels for one layer: with fp8 its scale table and the V
        layout's group (``slora_kernels.fp8``), else none."""
        if self.scales is None:
            return {}
        return {"scales": self.scales[index], "v_group": self.group if self.group > 1 else 0}

    def free_pages(self) -> np.ndarray:
        """The ids of the pages not in use, ascending."""
        return np.flatnonzero(~self._used).astype(np.int32)

    @property
    def num_free(self) -> int:
        return self._top * self.group

    @property
    def num_used(self) -> int:
        return (self.num_pages // self.group - self._top) * self.group

    def alloc(self, n: int, what: str = "") -> np.ndarray:
        """Take ``n`` pages; raises ``PoolExhausted`` (taking none) when fewer are free."""
        units = -(-n // self.group)
        if units > self._top:
            raise PoolExhausted(n, self.num_free, self.num_pages, what)
        taken = self._stack[self._top - units : self._top][::-1].copy()
        self._top -= units
        if self.group == 1:
            pages = taken
        else:
            pages = (taken[:, None] * self.group + np.arange(self.group)).reshape(-1)[:n]
            self._held[taken] = self.group
            if units:
                self._held[taken[-1]] = n - (units - 1) * self.group
        self._used[pages] = True
        self.peak_used = max(self.peak_used, self.num_used)
        return pages.astype(np.int32, copy=False)

    def free(self, pages: np.ndarray) -> None:
        """Give pages back. Freeing a page that is not in use is a bug and raises."""
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        if pages.size == 0:
            return
        index = np.arange(pages.size)
        self._last_index[pages] = index
        if not self._used[pages].all() or not (self._last_index[pages] == index).all():
            bad = pages[~self._used[pages]][:5].tolist()
            raise ValueError(f"double free of pages {bad} (or duplicates in {pages.size} pages)")
        self._used[pages] = False
        if self.group > 1:  # the groups whose last handed-out page this frees go back
            groups = pages // self.group
            np.subtract.at(self._held, groups, 1)
            pages = groups[self._held[groups] == 0]
            pages = pages[np.sort(np.unique(pages, return_index=True)[1])]
        self._stack[self._top : self._top + pages.size] = pages[::-1]
        self._top += pages.size

    def layer(self, index: int) -> torch.Tensor:
        """The pool's view for one layer: [num_pages, page_size]."""
        return self.data[index]
