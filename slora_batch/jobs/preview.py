"""``preview``: a few finished outputs of a job next to their prompts, for the run summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.requests.request import Request
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.manifest import read_manifest
from slora_batch.jobs.openai_input import OpenAIBatch, holds_openai_lines
from slora_batch.jobs.outdir import OutputError, part_files
from slora_batch.jobs.prompts import Prompts
from slora_batch.jobs.reader import InputError, first_record, iter_input_files, read_rows
from slora_batch.jobs.rows import RowSource, to_request
from slora_batch.jobs.schema import adapter_name


@dataclass
class PreviewRow:
    id: str
    adapter: str | None
    prompt: str
    text: str
    finish_reason: str


def preview(job: JobConfig, limit: int = 5, scan: int = 50) -> list[PreviewRow]:
    """A few finished outputs with their prompts, taken from the first ``scan`` input rows: with
    fan-out one prompt across its adapters (base first), else the first outputs in input order;
    of a row's n samples, the first (a part written before ``sample_index`` holds only those).
    Scored rows generate no text: they are not shown."""
    parts = part_files(job.output)
    if not parts:
        return []
    int_ids = pq.read_schema(parts[0][1]).field("id").type == pa.int64()
    prompts: dict[Any, str] = {}
    try:
        files = iter_input_files(job.input)
        openai = holds_openai_lines(job.input_format, files, first_record(files))
        # ids are all the preview needs: any body.model reads as an adapter
        batch = OpenAIBatch((), None, job.columns) if openai else None
        settings = Prompts.of(job)
        rows = read_rows(
            files,
            job.columns,
            openai=batch,
            fields=settings.fields,
            limit=job.limit,
            position_ids=_position_ids(job),
        )
        for row in rows:
            if len(prompts) == scan:
                break
            item = to_request(row, job.sampling, job.fanout is not None, settings)
            if isinstance(item, Request) and not isinstance(item.id, RowSource):
                # as stored: an int64 id column means every id is an int
                prompts.setdefault(item.id if int_ids else str(item.id), _prompt_text(item))
    except InputError:
        return []
    if not prompts:
        return []
    found: dict[Any, list[dict[str, Any]]] = {}
    for _, path in parts:
        filters = [("id", "in", list(prompts)), ("finish_reason", "not in", ["error", "score"])]
        if "sample_index" in pq.read_schema(path).names:
            filters.append(("sample_index", "=", 0))
        table = pq.read_table(
            path, columns=["id", "adapter", "text", "finish_reason"], filters=filters
        )
        for row in table.to_pylist():
            row["adapter"] = adapter_name(row["adapter"])  # "" in parts, null in older ones
            found.setdefault(row["id"], []).append(row)
    ids = [i for i in prompts if i in found]
    if job.fanout is not None:
        ids = ids[:1]
    rows = [
        PreviewRow(str(i), r["adapter"], prompts[i], r["text"], r["finish_reason"])
        for i in ids
        for r in sorted(found[i], key=lambda r: (r["adapter"] is not None, r["adapter"] or ""))
    ]
    return rows[:limit]


def _position_ids(job: JobConfig) -> bool:
    """Whether the output's rows take their ids from input positions (its manifest's scan)."""
    try:
        manifest = read_manifest(job.output)
    except OutputError:
        return False
    return bool(manifest and manifest.get("scan", {}).get("position_ids"))


def _prompt_text(request: Request) -> str:
    if request.prompt is not None:
        return request.prompt
    users = [m["content"] for m in request.messages or [] if m["role"] == "user"]
    return users[-1] if users else (request.messages or [{"content": ""}])[-1]["content"]
