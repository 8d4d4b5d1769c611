"""A decode graph bucket's per-step inputs packed in one byte buffer: one host-to-device copy a
step instead of one per array.

Each field is a fixed slice of the buffer (``FIELDS``), 128-byte aligned, so that a graph's static
inputs are views of its one device buffer and the host fills numpy views of a staged copy.
Running example, bucket 512: input_ids at bytes [0, 4096) as int64 [512], positions [4096, 8192),
..., out_pages as int32 [512, 2]; a step writes its rows into the numpy views of a staged set and
``copy_`` moves all of it (about 26 KB) at once.
"""

from __future__ import annotations

import numpy as np
import torch

# name, dtype, shape as (rows per bucket row, extra rows, trailing dims): seg1_start is
# [bucket + 1], out_pages [bucket, 2]. prev_rows: the previous step's row drawing each row's input
# id (-1: none); pos_seg: read by the tiled kernels (tiled graphs, aligned steps of vector ones).
FIELDS = (
    ("input_ids", torch.int64, 0, ()),
    ("positions", torch.int64, 0, ()),
    ("prev_rows", torch.int64, 0, ()),
    ("out_pages", torch.int32, 0, (2,)),
    ("b_seq_len", torch.int32, 0, ()),
    ("b_slot", torch.int32, 0, ()),
    ("token_order", torch.int32, 0, ()),
    ("seg1_start", torch.int32, 1, ()),
    ("seg_slot", torch.int32, 0, ()),
    ("pos_seg", torch.int32, 0, ()),
)
ALIGN = 128  # bytes: each field starts where a kernel's vector loads expect it


class StagedInputs:
    """The byte layout of one bucket's fields, and two staged host sets of it (pinned on CUDA)
    used in turn: a set is refilled two steps after its last use, and the engine has read back
    that step by then, so its copy from the set has run."""

    def __init__(self, bucket: int, device: torch.device) -> None:
        self.bucket = bucket
        self.slices: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, extra, trailing in FIELDS:
            shape = (bucket + extra, *trailing)
            size = int(np.prod(shape)) * dtype.itemsize
            self.slices[name] = (offset, offset + size, dtype, shape)
            offset += -(-size // ALIGN) * ALIGN
        self.nbytes = offset
        pin = device.type == "cuda"
        self._sets = [torch.zeros(offset, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._arrays = [self._views(staged.numpy()) for staged in self._sets]
        self._uses = 0

    def _views(self, buffer):
        """Each field's view of a byte buffer (numpy array or tensor)."""
        views = {}
        for name, (start, end, dtype, shape) in self.slices.items():
            part = buffer[start:end]
            if isinstance(part, np.ndarray):
                views[name] = part.view(torch.empty(0, dtype=dtype).numpy().dtype).reshape(shape)
            else:
                views[name] = part.view(dtype).view(shape)
        return views

    def device_buffer(self, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A graph's packed device buffer (zeros) and its fields' views: the graph's static
        inputs."""
        packed = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        return packed, self._views(packed)

    def next(self) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """The set to fill this step: its buffer and its fields' numpy views."""
        self._uses += 1
        which = self._uses % 2
        return self._sets[which], self._arrays[which]
