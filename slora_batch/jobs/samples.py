"""n samples per row, exactly once: what a row owes the output and what it holds.

Words: an *input row* is a line or row of the input; a *row* of the output (what parts,
``_stats.parquet``, progress and the summary count) is one sample of one input row for one
adapter, ``(id, adapter, sample_index)``. An input row makes ``n`` rows per adapter (its ``n``
column, else the job's ``sampling.n`` for a generated row and 1 for a scored one), sample k seeded by (seed, id, k) so that it is the same
whenever it is made; an input row that fails (a bad line, a bad ``n``, an unknown adapter) makes
one error row, which stands for all its samples.

Resume (``DoneSamples``): a row is done when every sample is committed or an error row is; a row
with some samples committed is fed again asking for the others (``Request.sample_indices``).
``SamplesDue`` follows the requests in the engine: a failed request's one error row takes the
first index it asked for, so it never repeats a committed sample's index.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slora_batch.engine.config import ConfigError, SamplingConfig
from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.rows import row_key

# -1 is ...1111 in two's complement (Python ints are unbounded): ``ERROR_BITS >> k & 1`` is 1 for
# every k, so an error row counts as every sample of its row committed, whatever its n.
ERROR_BITS = -1


def row_samples(n: Any, sampling: SamplingConfig, scored: bool = False) -> int:
    """Rows an input row makes per adapter: its ``n`` column (None: ``sampling.n``), or 1 when
    that is not a valid n (the row is one error row). A scored row makes 1: the job's n is for
    generated rows, and a scored row's own n > 1 makes it an error row. ``SamplingConfig`` says
    what is valid."""
    if scored:
        return 1
    if n is None:
        return sampling.n
    try:
        return dataclasses.replace(sampling, n=n).n
    except (ConfigError, TypeError, ValueError):
        return 1


class DoneSamples:
    """The samples in committed parts, per row key (``rows.row_key``): bit k is set when sample
    k is committed; an error row sets every bit (``ERROR_BITS``).

    Running example: sample 0 and 2 of a row with n = 4 committed: bits 0b101,
    ``missing(key, 4)`` is [1, 3]; after its samples 1 and 3, [] (done)."""

    def __init__(self) -> None:
        self.bits: dict[str, int] = {}
        self.rows = 0  # output rows read

    def add(self, key: str, sample_index: int, error: bool) -> None:
        self.rows += 1
        self.bits[key] = ERROR_BITS if error else self.bits.get(key, 0) | 1 << sample_index

    def missing(self, key: str, n: int) -> list[int]:
        """The sample indices of row ``key`` (of ``n``) not committed; [] when it is done."""
        bits = self.bits.get(key, 0)
        return [k for k in range(n) if not bits >> k & 1]

    def keys(self) -> set[str]:
        """The rows with a committed sample or error row."""
        return set(self.bits)

    def __len__(self) -> int:
        return self.rows


def resumed(item: Request | Result, missing: list[int], n: int) -> Request | Result:
    """``item`` for a row whose ``missing`` samples (of ``n``) are not yet committed: asking
    for only those when some are; an error row takes the first missing index."""
    if len(missing) == n:
        return item
    if isinstance(item, Result):
        return dataclasses.replace(item, sample_index=missing[0])
    return dataclasses.replace(item, sample_indices=missing)


class SamplesDue:
    """The samples the engine owes per request in flight, by row key, for a failed request: its
    one error row (``Result.failed``, sample_index 0) takes the first index the request asked
    for, so a resumed row asked for [1, 2] fails as sample 1 beside its committed sample 0, and
    stands for every sample the request still owed (``finished`` says how many).

    Only requests of more than one sample or asked for given ones are held."""

    def __init__(self) -> None:
        self._due: dict[str, tuple[int, int]] = {}  # row key -> (samples owed, first index)

    def add(self, request: Request, samples: int) -> None:
        """``request`` entered the engine owing ``samples`` rows."""
        first = request.sample_indices[0] if request.sample_indices else 0
        if samples > 1 or first:
            self._due[row_key(request.id, request.adapter)] = (samples, first)

    def finished(self, result: Result) -> int:
        """The rows ``result`` stands for: 1, or for an error row every sample still owed."""
        if not self._due:
            return 1
        key = row_key(result.id, result.adapter)
        due = self._due.pop(key, None)
        if due is None:
            return 1
        samples, first = due
        if result.finish_reason == "error":
            result.sample_index = first
            return samples
        if samples > 1:
            self._due[key] = (samples - 1, first)
        return 1
