"""``slora-batch validate``: every check a run makes before any work, plus the input's schema and
a sample of its rows turned into requests and tokenized as the engine would; no engine is built
and no weights are loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.adapters import AdapterInfo
from slora_batch.io import InputError, read_rows, to_request
from slora_batch.job import JobConfig
from slora_batch.jobrun import _job_error, check_job
from slora_batch.request import Request, Result
from slora_batch.spec import ModelSpec
from slora_batch.tokens import load_tokenizer, tokenize

VALIDATE_ROWS = 200  # input rows validate_job turns into requests and tokenizes


@dataclass
class ValidationReport:
    job: str
    model: str
    spec: ModelSpec
    adapters: list[AdapterInfo]
    files: list[Path]
    rows_total: int | None  # input rows (before fan-out), None when not counted
    sweep: list[str | None] | None
    rows_checked: int
    problems: list[str]  # schema and sample-row problems: runs would write error rows for them


def validate_job(job: JobConfig) -> ValidationReport:
    """``check_job``, then the Parquet schemas and the first ``VALIDATE_ROWS`` rows turned into
    requests and tokenized as the engine would. Builds no engine and loads no weights (only the
    sample alias's one-time conversion reads its GGUF); problems of rows are reported (a run
    writes error rows for them), problems of the job raise."""
    plan = check_job(job)
    problems = [problem for file in plan.files for problem in _schema_problems(file, job.columns)]
    tokenizer = load_tokenizer(plan.model_path)
    limit = min(job.engine.max_model_len or plan.spec.max_context, plan.spec.max_context)
    known = None if plan.sweep is not None else {a.name for a in plan.adapters}
    checked = 0
    try:
        for row in read_rows(plan.files, job.columns):
            if checked == VALIDATE_ROWS:
                break
            checked += 1
            item = to_request(row, job.sampling)
            if isinstance(item, Result):
                problems.append(item.error)
                continue
            problem = _request_problem(item, known, tokenizer, plan.spec, limit)
            if problem:
                problems.append(f"{row.where}: {problem}")
    except InputError as exc:
        raise _job_error(job, exc) from exc
    return ValidationReport(
        job=job.name,
        model=str(plan.model_path),
        spec=plan.spec,
        adapters=plan.adapters,
        files=plan.files,
        rows_total=plan.rows_total,
        sweep=plan.sweep,
        rows_checked=checked,
        problems=problems,
    )


_ARROW_TYPES = {  # accepted column types; an all-null column (type null) is always fine
    "id": (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_null),
    "adapter": (pa.types.is_string, pa.types.is_large_string, pa.types.is_null),
    "prompt": (pa.types.is_string, pa.types.is_large_string, pa.types.is_null),
    "messages": (pa.types.is_list, pa.types.is_large_list, pa.types.is_null),
}


def _schema_problems(file: Path, columns: dict[str, str]) -> list[str]:
    if file.suffix.lower() != ".parquet":
        return []  # JSONL has no schema: the sample of rows covers it
    schema = pq.read_schema(file)
    if columns["prompt"] not in schema.names and columns["messages"] not in schema.names:
        return [
            f"{file}: no column {columns['prompt']!r} or {columns['messages']!r}: "
            "every row will be an error row"
        ]
    problems = []
    for key, checks in _ARROW_TYPES.items():
        name = columns[key]
        if name in schema.names and not any(ok(schema.field(name).type) for ok in checks):
            problems.append(
                f"{file}: column {name!r} has type {schema.field(name).type}: "
                "its non-null values will be error rows"
            )
    return problems


def _request_problem(
    request: Request, known: set[str] | None, tokenizer, spec: ModelSpec, limit: int
) -> str | None:
    """Why the engine would turn this request into an error row, or None."""
    if known is not None and request.adapter is not None and request.adapter not in known:
        return f"unknown adapter {request.adapter!r} ({len(known)} adapters known)"
    if tokenizer is None:
        return "the model has no tokenizer, so prompt and messages cannot be tokenized"
    try:
        n = len(tokenize(request, tokenizer, spec.vocab_size, spec.path))
    except Exception as exc:  # tokenizers and chat templates raise many types
        return f"cannot tokenize: {exc}"
    if n >= limit:
        return f"prompt of {n} tokens does not fit the context of {limit} tokens"
    return None
