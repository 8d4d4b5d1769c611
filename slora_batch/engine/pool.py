"""The unified page pool: one tensor, one free list, for KV cache and adapter weights alike.

A page is one vector of ``page_size`` elements in every layer: ``data[layer, page]``. A token's K
and V take one page each; an adapter of rank r takes r rows per factor and target, each row
ceil(width / page_size) pages, so its cost grows with r and never with another adapter's rank.

With an fp8 KV cache (``use_fp8_kv``) a token's K and V share one page in e4m3 (``slora_kernels.fp8``),
its page-table row names that page twice, and a side table holds the per token and head scales:
KV pages per token drop from 2 to 1 while adapter pages stay as they are.
"""

from __future__ import annotations

import numpy as np
import torch


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
    Python calls, ``free(ids)`` pushes them back.
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

    def use_fp8_kv(self, kv_heads: int, kv_dim: int) -> None:
        """KV in e4m3, one page per token, with its scale table (``slora_kernels.fp8``)."""
        page_bytes = self.page_size * self.data.element_size()
        if page_bytes < 2 * kv_dim:
            raise ValueError(
                f"an fp8 KV page holds K and V: {2 * kv_dim} bytes, pages have {page_bytes}"
            )
        self.kv_pages_per_token = 1
        self.scales = torch.ones(
            self.data.shape[0],
            self.num_pages,
            2 * kv_heads,
            dtype=torch.float32,
            device=self.data.device,
        )

    def kv_pages(self, n: int) -> np.ndarray:
        """KV pages for ``n`` tokens: [n, 2] (K page, V page); with fp8 both name one page."""
        pages = self.alloc(self.kv_pages_per_token * n).reshape(n, self.kv_pages_per_token)
        return pages if self.kv_pages_per_token == 2 else np.repeat(pages, 2, axis=1)

    def own_pages(self, pairs: np.ndarray) -> np.ndarray:
        """The distinct pool pages of (K page, V page) rows [n, 2], flat, for ``free``."""
        return pairs[:, : self.kv_pages_per_token].reshape(-1)

    def kv_args(self, index: int) -> dict:
        """Keywords of the KV kernels for one layer: its scale table with fp8, else none."""
        return {} if self.scales is None else {"scales": self.scales[index]}

    def free_pages(self) -> np.ndarray:
        """The ids of the pages not in use, ascending."""
        return np.flatnonzero(~self._used).astype(np.int32)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    def alloc(self, n: int, what: str = "") -> np.ndarray:
        """Take ``n`` pages; raises ``PoolExhausted`` (taking none) when fewer are free."""
        if n > self._top:
            raise PoolExhausted(n, self._top, self.num_pages, what)
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._used[pages] = True
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

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
        self._stack[self._top : self._top + pages.size] = pages[::-1]
        self._top += pages.size

    def layer(self, index: int) -> torch.Tensor:
        """The pool's view for one layer: [num_pages, page_size]."""
        return self.data[index]
