"""Which choice each adapter prefers: over the rows scored with choices, per adapter, the share
of rows whose ``best_choice`` (highest total log-probability) is each index, the same by
``best_choice_norm`` (highest mean per token: choices of different lengths compare fairly), and
the accuracy of those with an answer. Plain
data read from the committed parts, for the run summary (``console.py`` draws it).

Running example: adapter "a" has four choices rows whose best choices are 0, 0, 1, 2, three of
them with an answer and two of those right: shares [0.5, 0.25, 0.25] (three columns: the most
choices a row had), accuracy 2/3.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.outdir import part_files
from slora_batch.jobs.schema import adapter_name

MAX_CHOICE_COLUMNS = 8  # choice indices shown; a later index counts in ``beyond``
LABEL_CHARS = 16  # a choice's text in a column head, cut past this
COLUMNS = ["adapter", "best_choice", "best_choice_norm", "choice_tokens", "correct"]


@dataclass
class AdapterPreference:
    adapter: str | None  # None = base model
    rows: int  # the adapter's rows scored with choices
    shares: list[float]  # per choice index 0..columns-1: share of ``rows`` it was best in
    beyond: float  # share of ``rows`` whose best choice is past the last column
    shares_norm: list[float]  # the same two by best_choice_norm
    beyond_norm: float
    accuracy: float | None  # correct among its choices rows with an answer; None: no answer


@dataclass
class ChoicePreference:
    columns: int  # choice indices shown: the most choices a row had, at most MAX_CHOICE_COLUMNS
    most_choices: int  # the most choices a row had (more than ``columns`` when cut)
    adapters: list[AdapterPreference]  # base model first, then by name
    answers: bool  # whether any choices row had an answer (an accuracy column is worth showing)
    heads: list[str]  # per column: its index, and the choice's text when every row shares them


def column_heads(columns: int, labels: list[str] | None) -> list[str]:
    """The preference table's column heads: each index, followed by its label (the job's
    ``choice_labels``, or the choices every choices row shares), its whitespace collapsed and
    cut to ``LABEL_CHARS``. Running example: 3 columns, labels ["plain", "SHOUT  IT", "a very
    long pirate answer"] -> ["0 plain", "1 SHOUT IT", "2 a very long pir…"]; labels None ->
    ["0", "1", "2"]."""
    heads = []
    for index in range(columns):
        text = " ".join(labels[index].split()) if labels and index < len(labels) else ""
        if len(text) > LABEL_CHARS:
            text = text[: LABEL_CHARS - 1].rstrip() + "…"
        heads.append(f"{index} {text}" if text else str(index))
    return heads


def choice_preference(
    out_dir: str | Path | FsDir, labels: list[str] | None = None
) -> ChoicePreference | None:
    """The choice preference of every adapter over the committed parts; None when no row was
    scored with choices. Parts written before the scoring columns existed hold none.
    ``labels``: what each choice index means, if known (``column_heads``)."""
    fs = out_dir.fs if isinstance(out_dir, FsDir) else None
    picks: dict[str | None, dict[int, int]] = {}  # adapter -> best choice -> rows
    picks_norm: dict[str | None, dict[int, int]] = {}  # the same by best_choice_norm
    answered: dict[str | None, list[int]] = {}  # adapter -> [rows with an answer, correct]
    most = 0
    for _, path in part_files(out_dir):
        if "best_choice" not in pq.read_schema(str(path), filesystem=fs).names:
            continue
        table = pq.read_table(str(path), columns=COLUMNS, filesystem=fs)
        table = table.filter(pc.is_valid(table["best_choice"]))
        if table.num_rows == 0:
            continue
        most = max(most, pc.max(pc.list_value_length(table["choice_tokens"])).as_py() or 0)
        for key, into in (("best_choice", picks), ("best_choice_norm", picks_norm)):
            counted = table.group_by(["adapter", key]).aggregate([([], "count_all")])
            for row in counted.to_pylist():  # the base model: "" in parts, null in older ones
                per = into.setdefault(adapter_name(row["adapter"]), {})
                per[row[key]] = per.get(row[key], 0) + row["count_all"]
        right = table.group_by(["adapter"]).aggregate([("correct", "count"), ("correct", "sum")])
        for row in right.to_pylist():
            pair = answered.setdefault(adapter_name(row["adapter"]), [0, 0])
            pair[0] += row["correct_count"]
            pair[1] += row["correct_sum"] or 0
    if not picks:
        return None
    columns = min(most, MAX_CHOICE_COLUMNS)
    adapters = []
    for adapter in sorted(picks, key=lambda a: (a is not None, a or "")):
        rows = sum(picks[adapter].values())

        def split(per: dict[int, int], rows: int = rows) -> tuple[list[float], float]:
            shares = [per.get(i, 0) / rows for i in range(columns)]
            return shares, sum(n for i, n in per.items() if i >= columns) / rows

        shares, beyond = split(picks[adapter])
        shares_norm, beyond_norm = split(picks_norm.get(adapter, {}))
        with_answer, right = answered.get(adapter, [0, 0])
        accuracy = right / with_answer if with_answer else None
        adapters.append(
            AdapterPreference(adapter, rows, shares, beyond, shares_norm, beyond_norm, accuracy)
        )
    answers = any(a.accuracy is not None for a in adapters)
    return ChoicePreference(columns, most, adapters, answers, column_heads(columns, labels))
