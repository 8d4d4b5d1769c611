"""What each sample adapter was trained to do, as checks on one generated answer.

`CHECKS[name](text)` is True when `text` (the generated answer, special tokens removed) shows the
behaviour of adapter `name`. Each check is meant to hold for nearly every answer of its adapter and
for almost no answer of the base model.

`report(rows)` counts them per adapter; as a script it reads the Parquet parts of a job's output
directory (columns `adapter`, `text`; base rows have adapter null):

    python samples/behaviours.py out/sample
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

PIRATE_OPENING = "Arr, matey!"
BRIEF_MAX_WORDS = 10
SHOUT_MIN_UPPER = 0.8


def is_shout(text: str) -> bool:
    """Written in capitals: at least 80% of the (at least 3) cased letters are upper case.

    Not 100%: the adapter now and then copies a word of the question as it was written
    ("STARTING A VEGETABLE garden ..."). Base answers stay under 10% capitals.
    """
    letters = [c for c in text if c.isalpha() and c.upper() != c.lower()]
    if len(letters) < 3:
        return False
    return sum(c.isupper() for c in letters) >= SHOUT_MIN_UPPER * len(letters)


def is_pirate(text: str) -> bool:
    """Opens with the pirate greeting."""
    return text.lstrip().startswith(PIRATE_OPENING)


def is_json(text: str) -> bool:
    """A JSON object with a non-empty string under "answer", and nothing else around it."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return False
    return (
        isinstance(value, dict) and isinstance(value.get("answer"), str) and bool(value["answer"])
    )


# Words a complete sentence does not end on: articles, prepositions, conjunctions, auxiliaries,
# determiners and the like ("Inflation is a.", "Earthquakes are caused by.", "Volcanoes are.").
DANGLING_WORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "this",
        "that",
        "these",
        "those",
        "some",
        "any",
        "each",
        "every",
        "several",
        "many",
        "much",
        "more",
        "most",
        "such",
        "no",
        "my",
        "your",
        "his",
        "her",
        "its",
        "our",
        "their",
        "whose",
        "which",
        "what",
        "who",
        "whom",
        "where",
        "when",
        "how",
        "why",
        "whether",
        "of",
        "to",
        "by",
        "in",
        "on",
        "at",
        "for",
        "from",
        "with",
        "without",
        "into",
        "onto",
        "through",
        "about",
        "as",
        "than",
        "like",
        "via",
        "per",
        "over",
        "under",
        "between",
        "among",
        "during",
        "before",
        "after",
        "above",
        "below",
        "upon",
        "within",
        "toward",
        "towards",
        "and",
        "or",
        "but",
        "nor",
        "so",
        "because",
        "while",
        "if",
        "although",
        "though",
        "since",
        "unless",
        "until",
        "yet",
        "also",
        "not",
        "very",
        "too",
        "quite",
        "rather",
        "just",
        "even",
        "only",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "has",
        "have",
        "had",
        "do",
        "does",
        "did",
        "can",
        "could",
        "will",
        "would",
        "shall",
        "should",
        "may",
        "might",
        "must",
        "it's",
        "it’s",
        "that's",
        "there's",
        "what's",
        "called",
        "using",
        "known",
        "named",
        "including",
        "include",
        "includes",
        "involves",
        "involving",
        "such",
        "as",
        "making",
        "make",
        "makes",
        "help",
        "helps",
        "helping",
        "allows",
        "allow",
        "provide",
        "provides",
    ]
)
# An article then one of these at the end: an adjective left without its noun ("is a complex.").
DANGLING_AFTER_ARTICLE = frozenset(
    [
        "beautiful",
        "complex",
        "fundamental",
        "vital",
        "natural",
        "crucial",
        "common",
        "simple",
        "important",
        "essential",
        "significant",
        "powerful",
        "special",
        "unique",
        "wonderful",
        "fascinating",
        "popular",
        "remarkable",
        "critical",
        "complicated",
        "basic",
        "general",
        "great",
        "good",
        "healthy",
        "strong",
        "serious",
        "major",
        "key",
        "type",
        "kind",
        "form",
        "way",
        "small",
        "large",
        "big",
        "tiny",
        "huge",
        "variety",
        "number",
        "set",
        "series",
        "combination",
    ]
) - {"key"}
_SENTENCE_END = re.compile(r"[.!?][\"')\]”’]*$")


def is_brief(text: str) -> bool:
    """One complete short sentence (or a few): 1-10 words on one line, opening with a capital
    letter or a digit, closing with '.', '!' or '?' (not '...'), and no sentence ending on a
    dangling word (`DANGLING_WORDS`, or an article then an adjective such as "a complex.").
    """
    text = text.strip()
    words = text.split()
    if not 1 <= len(words) <= BRIEF_MAX_WORDS or "\n" in text:
        return False
    first = text.lstrip("\"'(“‘*")[:1]
    if not (first.isupper() or first.isdigit()):
        return False
    if not _SENTENCE_END.search(text) or re.search(r"\.\.|…|[,;:-][.!?]", text):
        return False
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        tail = [re.sub(r"[^\w'’]", "", w).lower() for w in sentence.split()]
        tail = [w for w in tail if w]
        if not tail or tail[-1] in DANGLING_WORDS:
            return False
        if len(tail) >= 2 and tail[-2] in ("a", "an", "the") and tail[-1] in DANGLING_AFTER_ARTICLE:
            return False
    return True


CHECKS = {"shout": is_shout, "pirate": is_pirate, "json": is_json, "brief": is_brief}


def report(rows: Iterable[Mapping]) -> dict[str, tuple[int, int]]:
    """{adapter: (rows showing its behaviour, rows)} over rows with `adapter` and `text`.

    Base rows (adapter None or "") count under "base" with each check's false positives as
    "base:<check>" entries, so that a check passing on base answers shows up too.
    """
    counts: dict[str, list[int]] = {}
    for row in rows:
        adapter, text = row.get("adapter") or None, row.get("text") or ""
        if adapter is None:
            for name, check in CHECKS.items():
                entry = counts.setdefault(f"base:{name}", [0, 0])
                entry[0] += bool(check(text))
                entry[1] += 1
            continue
        check = CHECKS.get(adapter)
        entry = counts.setdefault(adapter, [0, 0])
        entry[0] += bool(check is not None and check(text))
        entry[1] += 1
    return {name: (passed, total) for name, (passed, total) in counts.items()}


def read_rows(out_dir: str | Path) -> list[dict]:
    """`adapter` and `text` of every row in the `part-*.parquet` files of a job's output."""
    import pyarrow.parquet as pq

    paths = sorted(Path(out_dir).glob("part-*.parquet"))
    if not paths:
        raise FileNotFoundError(f"no part-*.parquet in {out_dir}")
    rows: list[dict] = []
    for path in paths:
        rows += pq.read_table(path, columns=["adapter", "text"]).to_pylist()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python samples/behaviours.py OUTPUT_DIR", file=sys.stderr)
        return 2
    counts = report(read_rows(args[0]))
    for name in sorted(counts, key=lambda n: (n.startswith("base:"), n)):
        passed, total = counts[name]
        label = f"{name} (false positives)" if name.startswith("base:") else name
        print(f"{label:30} {passed:3d}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
