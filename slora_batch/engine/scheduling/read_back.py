"""A step's drawn tokens, read back, into their rows (``Scheduler.postprocess``'s first half).

The seated rows' tokens go into the row table by array ops; the others (retired, finished or
preempted since their step launched) one by one. Only the rows that may finish -- a stop string
or a grammar to feed, an EOS token, their last token -- come back for a look of their own.
Running example: drawn [A, B, C], tokens [5, 2, 9], A and C seated, B retired (its last token),
EOS 2: A and C take 5 and 9 in their rows, B appends 2 to its own list; the rows to look at are
[(B, 2)] (EOS), plus A or C if a stop string, a grammar or their length watches them.
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np

from slora_batch.engine.requests.sequence import Sequence
from slora_batch.engine.scheduling.rows import RowTable


def read_back(
    table: RowTable,
    drawn: list[Sequence],
    tokens: list[int],
    b_eos: np.ndarray,
    eos: Set[int],
    mark: int | None = None,
) -> list[tuple[Sequence, int]]:
    """Appends ``tokens[i]`` to ``drawn[i]`` (one pending token fewer each) and returns the
    (row, token) pairs that may finish the row, in ``drawn`` order; a row already finished a
    step earlier (a wasted draw) takes nothing. ``b_eos``: the EOS ids, [E] int64. ``mark``:
    the table's ``mark()`` at launch for a step of its first rows (``ScheduledStep.rows``):
    their rows now follow from the leaves since, and only a row that left is looked up."""
    count = len(drawn)
    if mark is None:
        b_row = np.fromiter([s.row for s in drawn], np.int64, count)  # -1: not seated
    else:  # 420 sequences' own fields cost ~0.1 ms of cache misses a step (512 rows)
        b_row = table.rows_since(mark, count)
        for i in np.flatnonzero(b_row < 0).tolist():
            b_row[i] = drawn[i].row
    b_token = np.fromiter(tokens, np.int64, count)
    b_watch = np.zeros(count, dtype=np.bool_)
    seated = np.flatnonzero(b_row >= 0)
    rows = b_row[seated]
    table.b_pending[rows] -= 1
    table.add_outputs(rows, b_token[seated])
    b_watch[seated] = (
        table.b_watched[rows]
        | (table.b_outputs[rows] >= table.b_max_new[rows])
        | (b_token[seated, None] == b_eos).any(1)  # [n, E]: a few EOS ids; np.isin sorts
    )
    for i in np.flatnonzero(b_row < 0).tolist():
        seq, token = drawn[i], tokens[i]
        seq.pending -= 1
        if seq.finish_reason is not None:  # finished a step earlier: a wasted row
            continue
        seq.output_ids.append(token)
        b_watch[i] = (
            token in eos
            or len(seq.output_ids) >= seq.max_new_tokens
            or seq.detok is not None
            or seq.grammar is not None
        )
    return [(drawn[i], tokens[i]) for i in np.flatnonzero(b_watch).tolist()]
