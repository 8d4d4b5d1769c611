"""Greedy, temperature, top-k and top-p sampling, with randomness keyed by (seed, row id, step).

Each row's noise comes from a counter-based hash of its key, the step and the vocabulary index,
computed with integer tensor ops, so a row samples the same tokens whatever else is in its batch,
on any device. A draw is the Gumbel-max trick over the filtered, tempered logits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slora_batch.engine.device import to_device

_MASK63 = (1 << 63) - 1


def noise_key(seed: int, row_id: Any, sample: int = 0) -> int:
    """A stable 63-bit key for (seed, row id, sample index): the same in every process and on
    every run. The id counts by its canonical text (``str``: the int 7 and the string "7" are
    one id, as resume and the output's string id column have them), keyed as an int id always
    was, so an int id's samples draw what they drew before: sample 0 on "int" and the id's
    text, sample k on the text of the tuple (id, k). Running example: 7 and "7", sample 2 ->
    both hash "0\x00tuple\x00(7, 2)" at seed 0."""
    text = str(row_id)
    body = f"int\x00{text}" if sample == 0 else f"tuple\x00({text}, {sample})"
    digest = hashlib.blake2b(f"{seed}\x00{body}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & _MASK63


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows sampled in one step, as tensors on the logits' device.

    temperature [S] fp32 (0 = greedy); top_k [S] int64 (0 = off); top_p [S] fp32;
    key [S] int64 from ``noise_key``; step [S] int64: index of the token being drawn.
    any_sampled: whether a row has temperature > 0 (known on the host, so greedy needs no sync).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    key: torch.Tensor
    step: torch.Tensor
    any_sampled: bool = True

    @classmethod
    def build(cls, temperature, top_k, top_p, key, step, device: torch.device) -> SamplingBatch:
        """Per sampled row (sequences or numpy arrays, [S] each): temperature, top_k, top_p,
        key, step."""
        temperature = np.asarray(temperature, dtype=np.float32)
        return cls(
            temperature=to_device(temperature, device),
            top_k=to_device(top_k, device, torch.int64),
            top_p=to_device(top_p, device, torch.float32),
            key=to_device(key, device, torch.int64),
            step=to_device(step, device, torch.int64),
            any_sampled=bool((temperature > 0).any()),
        )


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit finalizer (splitmix64's, in wrapping int64 arithmetic)."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685  # 0x94d049bb133111eb as int64
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def uniform_noise(key: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) per (row, vocab index), a pure function of (key, step, index). Shape [S, vocab]."""
    index = torch.arange(vocab, dtype=torch.int64, device=key.device)
    state = _mix(key[:, None] * 1000003 + step[:, None])
    bits = _mix(state ^ (index[None, :] * -7046029254386353131))
    mantissa = (bits >> 11) & ((1 << 52) - 1)
    return (mantissa.double() + 0.5) / float(1 << 52)


def sample(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Next token per row. logits [S, vocab] fp32 -> [S] int64.

    Semantics: greedy argmax where temperature == 0; otherwise keep the top_k largest logits
    (top_k > 0) and the smallest set whose softmax mass reaches top_p, divide by temperature and
    draw with Gumbel-max using ``uniform_noise(key, step)``.
    """
    greedy = logits.argmax(dim=-1)
    if not params.any_sampled:  # decided on the host: no device sync for greedy batches
        return greedy
    sampled_rows = params.temperature > 0
    temp = torch.where(sampled_rows, params.temperature, torch.ones_like(params.temperature))
    scaled = logits.float() / temp[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(
        params.top_k > 0, params.top_k.clamp(max=vocab), torch.full_like(params.top_k, vocab)
    )
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= params.top_p[:, None]
    drop[:, 0] = False
    filtered = torch.full_like(scaled, float("-inf")).scatter(
        1, order, sorted_logits.masked_fill(drop, float("-inf"))
    )
    gumbel = -torch.log(-torch.log(uniform_noise(params.key, params.step, vocab)))
    drawn = (filtered.double() + gumbel).argmax(dim=-1)
    return torch.where(sampled_rows, drawn, greedy)
