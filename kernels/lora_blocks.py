"""Block sizes of the LoRA kernels: the ``BLOCKS`` knobs, and the tiles the shrink and expand
launchers pick from them for a step (tokens per block, rank rows, row elements).

``BLOCKS`` is one dict that ``slora_kernels.lora_shrink`` and ``slora_kernels.lora_expand`` import: change
its items (``monkeypatch.setitem``, ``BLOCKS.update``), never rebind the name, which the
launchers would not see. A process started with ``SLORA_LORA_BLOCKS`` set to a JSON object
(``'{"valign": 1}'``) starts from those items: engine runs side by side, a knob apiece
(``overrides``).
"""

from __future__ import annotations

import json
import os

import triton

# Block sizes; the tests shrink them to reach every branch on tiny shapes. Blocks along a row are
# also capped by the largest power of two dividing page_size; tl.dot blocks stay >= 16. The
# sizes keep sm_90 builds spill-free (tests/test_kernels_build.py). Picked from sweeps on the
# H200 (benchmarks/h200-tuning/): decode steps of 256 and 128 tokens on 1000 adapters, and a
# step of 248 decode rows with 16 prompt chunks of 280 tokens.
BLOCKS = {
    "rank": 32,  # shrink: rank columns per program
    "k": 128,  # shrink: row elements per loop step
    "n": 64,  # expand: columns per program
    "split_min_k": 256,  # shrink: the fewest row elements a split reduces
    "vk": 256,  # vector shrink: row elements per loop step (at 64 rank rows; scaled to keep
    # the [rank, vk] tile at 16K elements)
    "vn": 256,  # vector expand: columns per program (likewise)
    "vwarps": 4,  # vector shrink: warps per program
    "vnwarps": 4,  # vector expand: warps per program
    "vwaves": 4,  # vector shrink: split d_in until the grid holds this many programs per SM
    "et": 64,  # tiled expand: tokens per block in prefill-sized steps
    "dt": 16,  # tiled shrink: tokens per block in decode-sized steps (at most 256 tokens)
    "det": 16,  # tiled expand: tokens per block in decode-sized steps
    "vr": 16,  # vector kernels: rank rows per step (0: the largest rank of the step at once)
    "vgrid": 1,  # vector shrink: 1 puts the rank-row blocks in the grid instead of a loop
    "vsorted": 1,  # vector kernels of graph decode steps: 1 runs the tokens in slot order
    "vstages": 2,  # vector shrink: software-pipeline stages of the d_in loop (0: plain loop)
    "twarps": 4,  # tiled kernels: warps per program
    "er": 16,  # tiled expand: rank rows per dot, looped to each segment's own rank (0: the
    # step's largest rank in one dot, every segment padded to it: 26% slower in the mixed step)
    "valign": 0,  # graph decode steps: 1 runs the tiled kernels one adapter chunk a program
    # (``lora_paths.aligned_step``) instead of the vector kernels one token a program
    "at": 16,  # aligned steps: tokens of a segment per program
    "ar": 16,  # aligned shrink: rank rows per program
    "an": 256,  # aligned expand: columns per program
}


def overrides(text: str) -> dict[str, int]:
    """The knobs a ``SLORA_LORA_BLOCKS`` value sets: a JSON object of known knobs to ints;
    anything else is a ValueError naming the variable and the knob."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"SLORA_LORA_BLOCKS is not JSON: {exc}") from exc
    if not isinstance(items, dict):
        raise ValueError(f"SLORA_LORA_BLOCKS must be a JSON object of knobs, not {text!r}")
    for knob, value in items.items():
        if knob not in BLOCKS:
            raise ValueError(f"SLORA_LORA_BLOCKS: unknown knob {knob!r} (known: {sorted(BLOCKS)})")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"SLORA_LORA_BLOCKS: knob {knob!r} takes an int, not {value!r}")
    return items


BLOCKS.update(overrides(os.environ.get("SLORA_LORA_BLOCKS", "{}")))


def block_tokens(num_tokens: int, expand: bool = False) -> int:
    """Tokens per block of the tiled shrink (expand): BLOCKS["dt"] (["det"]) in decode-sized
    steps, at most 256 tokens; in prefills 32 (64 spilled on sm_90 at BLOCK_K 128 and 4 warps)
    (BLOCKS["et"])."""
    if num_tokens <= 256:
        return BLOCKS["det" if expand else "dt"]
    return BLOCKS["et"] if expand else 32


def vector_block(page: int, max_rank: int, knob: str) -> tuple[int, int]:
    """The vector kernels' tile (rank rows, row elements): the whole largest rank at once, or
    with BLOCKS["vr"] > 0 that many rows at a time, so an adapter's loop runs to its own rank
    only; and BLOCKS[knob] ("vk": shrink, "vn": expand) row elements at 64 rows, scaled to keep
    the tile's size, capped by what divides page."""
    whole = _whole_rank(max_rank)
    block_r = min(whole, BLOCKS["vr"]) if BLOCKS["vr"] else whole
    return block_r, _pow2_divisor(page, max(16, BLOCKS[knob] * 64 // block_r))


def expand_rank_block(max_rank: int) -> int:
    """Rank rows per dot of the tiled expand: the step's largest rank at once (at least 16, as
    tl.dot needs), or with BLOCKS["er"] that many, looped to each segment's own rank."""
    whole = _whole_rank(max_rank)
    return min(whole, max(16, BLOCKS["er"])) if BLOCKS["er"] else whole


def aligned_rank_block(max_rank: int) -> int:
    """Rank rows per program of the tiled shrink in an aligned step: BLOCKS["ar"], at most the
    step's largest rank as one tile."""
    return min(max(16, BLOCKS["ar"]), _whole_rank(max_rank))


def tiled_rank_block(max_rank: int) -> int:
    """Rank columns per program of the tiled shrink."""
    return min(BLOCKS["rank"], _whole_rank(max_rank))


def _whole_rank(max_rank: int) -> int:
    """The step's largest rank as one tile: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(max_rank))


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (example: 4096, 256 -> 256; 192, 256 -> 64)."""
    block = 1
    while block * 2 <= cap and n % (block * 2) == 0:
        block *= 2
    return block
