"""OpenAI Batch API files out (``output_format: openai``): ``_openai_output.jsonl`` and
``_openai_errors.jsonl`` rebuilt from the committed parts when a job completes, so a re-run
after a kill writes them whole. The parts stay the source of truth for resume. Their names start
with "_" so that readers of the output's Parquet files (pyarrow datasets, pandas, Spark) skip
them; an earlier version's ``output.jsonl`` and ``errors.jsonl`` are replaced by them (removed
when they are written, and a complete job that still has them writes them anew).

A custom_id is in one file only: the output file holds the result of its first line, or the
error file its first line's error. A later line that repeats a custom_id is one error line of
its own whose ``custom_id`` is null (the id is the first line's), its message naming its line,
the custom_id and the first line that used it.

Output line: ``{"id": "batch_req_...", "custom_id", "response": {"status_code": 200,
"request_id", "body": <chat.completion | text_completion>}, "error": null}``, one per custom_id
with its n samples as ``choices``; error line: ``{"id", "custom_id", "response": null, "error":
{"code", "message"}}``. Which body a row gets comes from its kept ``openai_request`` column (the
line's url). Ids are digests of the job and the custom_id: a rebuild writes the same ones.

Memory: one count per output id (a first pass), then the samples of ids not yet complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.openai_input import CHAT, REQUEST_COLUMN, base_model_name
from slora_batch.jobs.outdir import commit_file

logger = logging.getLogger(__name__)

OUTPUT_FILE, ERRORS_FILE = "_openai_output.jsonl", "_openai_errors.jsonl"
OLD_FILES = ("output.jsonl", "errors.jsonl")  # an earlier version's names: read as data
COLUMNS = (
    "id",
    "adapter",
    "sample_index",
    "text",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
    "source",
    "logprobs",
    REQUEST_COLUMN,
)
FLOOR_LOGPROB = -9999.0  # OpenAI's stand-in for a probability of zero (JSON has no -inf)


def job_openai_files(
    out_dir: Path | FsDir,
    parts: list[tuple[int, Path]],
    job_name: str,
    model: str,
    complete: bool,
) -> None:
    """A job's OpenAI files once its run is committed: written from its committed ``parts``
    (``outdir.part_files``' list), or for a job that was ``complete`` already only when they
    are stale (``openai_stale``). A local output only: an output elsewhere keeps its parts
    alone (said after a run)."""
    if isinstance(out_dir, FsDir):
        if not complete:
            logger.warning("job %s: output_format openai writes a local output only", job_name)
        return
    if not complete or openai_stale(out_dir):
        write_openai_files(out_dir, parts, job_name, base_model_name(model))


def write_openai_files(
    out_dir: str | Path, parts: list[tuple[int, Path]], job_name: str, base_model: str
) -> tuple[int, int]:
    """Rebuild both files of ``out_dir`` from its committed ``parts``; (output lines, error
    lines). ``base_model``: the name the bodies give base-model rows."""
    out_dir = Path(out_dir)
    counts: Counter = Counter()
    for rows in _part_rows(parts, ("id", "source")):
        counts.update(_key(row) for row in rows)
    written = [0, 0]
    # when the rows were made: the newest part's commit, so a rebuild from the same parts (after
    # a kill, or of an earlier version's files) writes the same lines
    created = int(max((path.stat().st_mtime for _, path in parts), default=time.time()))

    def write_both(output, errors) -> None:
        for group in _groups(parts, counts):
            line, failed = _line(group, job_name, base_model, created)
            (errors if failed else output).write(json.dumps(line, ensure_ascii=False).encode())
            (errors if failed else output).write(b"\n")
            written[failed] += 1

    commit_file(
        out_dir / OUTPUT_FILE,
        lambda output: commit_file(
            out_dir / ERRORS_FILE, lambda errors: write_both(output, errors)
        ),
    )
    for name in OLD_FILES:
        if (out_dir / name).is_file():
            logger.info("removing %s (now %s and %s)", out_dir / name, OUTPUT_FILE, ERRORS_FILE)
            (out_dir / name).unlink()
    logger.info("wrote %s (%d lines) and %s (%d)", OUTPUT_FILE, written[0], ERRORS_FILE, written[1])
    return written[0], written[1]


def openai_stale(out_dir: str | Path) -> bool:
    """Whether a complete job's OpenAI files are to be written again: one is missing, or an
    earlier version's names are still there."""
    out_dir = Path(out_dir)
    missing = not all((out_dir / name).is_file() for name in (OUTPUT_FILE, ERRORS_FILE))
    return missing or any((out_dir / name).is_file() for name in OLD_FILES)


def _part_rows(parts: list[tuple[int, Path]], columns: tuple[str, ...]) -> Iterator[list[dict]]:
    for _, path in parts:
        names = pq.read_schema(path).names
        yield pq.read_table(path, columns=[c for c in columns if c in names]).to_pylist()


def _key(row: dict) -> str:
    """An output id's key: its custom_id, or the line (``source``) of a row without one."""
    return f"id:{row['id']}" if row.get("id") is not None else f"source:{row.get('source')}"


def _groups(parts: list[tuple[int, Path]], counts: Counter) -> Iterator[list[dict]]:
    """Every output id's rows (its samples, by index), as soon as the last one is read."""
    pending: dict[str, list[dict]] = {}
    for rows in _part_rows(parts, COLUMNS):
        for row in rows:
            key = _key(row)
            group = pending.setdefault(key, [])
            group.append(row)
            if len(group) == counts[key]:
                del pending[key]
                yield sorted(group, key=lambda r: r["sample_index"])


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _line(group: list[dict], job: str, base_model: str, created: int) -> tuple[dict, bool]:
    """(the file line of one custom_id, or of a line without a usable or new one, whether it
    goes to the error file)."""
    first = group[0]
    custom_id = first["id"]  # null: no custom_id of its own (none given, or a repeated one)
    key = custom_id if first["id"] is not None else first["source"]
    line_id = f"batch_req_{_digest(job, 'line', key)}"
    failed = next((row for row in group if row["finish_reason"] == "error"), None)
    if failed is not None:
        error = {"code": "invalid_request", "message": failed["error"]}
        return {"id": line_id, "custom_id": custom_id, "response": None, "error": error}, True
    request = json.loads(first.get(REQUEST_COLUMN) or "{}")
    chat = request.get("url") == CHAT
    choices = [_choice(row, index, chat) for index, row in enumerate(group)]
    completion = sum(row["completion_tokens"] for row in group)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{_digest(job, 'body', key)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": first["adapter"] or base_model,
        "choices": choices,
        "usage": {
            "prompt_tokens": first["prompt_tokens"],  # one prompt for the n samples
            "completion_tokens": completion,
            "total_tokens": first["prompt_tokens"] + completion,
        },
    }
    response = {
        "status_code": 200,
        "request_id": f"req_{_digest(job, 'request', key)}",
        "body": body,
    }
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}, False


def _choice(row: dict, index: int, chat: bool) -> dict:
    entries = row.get("logprobs")
    if chat:
        logprobs = (
            None
            if entries is None
            else {"content": [_chat_entry(e) for e in entries], "refusal": None}
        )
        message = {"role": "assistant", "content": row["text"], "refusal": None}
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": row["finish_reason"],
        }
    logprobs = None if entries is None else _completion_logprobs(entries)
    return {
        "index": index,
        "text": row["text"],
        "logprobs": logprobs,
        "finish_reason": row["finish_reason"],
    }


def _logprob(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else FLOOR_LOGPROB


def _token(entry: dict) -> dict:
    text = entry.get("text") or ""
    return {"token": text, "logprob": _logprob(entry.get("logprob")), "bytes": list(text.encode())}


def _chat_entry(entry: dict) -> dict:
    return {**_token(entry), "top_logprobs": [_token(t) for t in entry.get("top") or ()]}


def _completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions shape: parallel lists, the alternatives as {token: logprob}."""
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.get("text") or "")
    return {
        "tokens": [entry.get("text") or "" for entry in entries],
        "token_logprobs": [_logprob(entry.get("logprob")) for entry in entries],
        "top_logprobs": [
            {t.get("text") or "": _logprob(t.get("logprob")) for t in entry.get("top") or ()}
            for entry in entries
        ],
        "text_offset": offsets,
    }
