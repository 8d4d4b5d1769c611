"""Writes samples/eval.jsonl, the sample multiple-choice set of jobs/sample-eval.yaml.

For each of the first ``--items`` questions of prompts.jsonl, five choices: the first sentence of
the answer that the base model and each sample adapter gave it in the sample job, in the order
plain (base model), shout, pirate, json, brief. A pirate answer keeps its greeting and a JSON one
its object around the first sentence. Scored by every adapter, each should find its own style's
choice the most likely (per token: ``best_choice_norm``).

    slora-batch run jobs/sample.yaml && python samples/make_eval.py out/sample
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

STYLES = ("plain", "shout", "pirate", "json", "brief")  # choice i is in style STYLES[i]
ADAPTER = {"plain": None, "shout": "shout", "pirate": "pirate", "json": "json", "brief": "brief"}
PIRATE = "Arr, matey!"
HERE = Path(__file__).parent


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s+", text.strip())[0]


def in_style(text: str) -> str:
    """The first sentence of an answer, keeping a pirate greeting or a JSON object around it."""
    text = text.strip()
    if text.startswith("{"):
        try:
            inner = json.loads(text)["answer"]
        except (ValueError, KeyError, TypeError):  # cut at 64 tokens: not closed
            inner = text.split('": "', 1)[-1]
        return json.dumps({"answer": first_sentence(inner)})
    if text.startswith(PIRATE):
        return f"{PIRATE} {first_sentence(text[len(PIRATE) :])}"
    return first_sentence(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the sample job's output directory")
    parser.add_argument("--items", type=int, default=10)
    parser.add_argument("--out", type=Path, default=HERE / "eval.jsonl")
    args = parser.parse_args()
    import pyarrow.dataset as ds

    answers: dict[tuple, str] = {}
    for row in ds.dataset(args.output, format="parquet").to_table().to_pylist():
        answers[row["adapter"] or None, row["id"]] = row["text"]  # base: "" (null before)
    lines = []
    for line in (HERE / "prompts.jsonl").read_text().splitlines()[: args.items]:
        prompt = json.loads(line)
        choices = [in_style(answers[ADAPTER[style], prompt["id"]]) for style in STYLES]
        lines.append(json.dumps({**prompt, "choices": choices}, ensure_ascii=False))
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} items written to {args.out}")


if __name__ == "__main__":
    main()
