"""``slora-batch validate``: every check a run makes before any work, the scan a run makes of its
input (duplicate rows, columns neither used nor kept, the id and kept columns' types), the
Parquet schemas, and a sample of rows turned into requests and tokenized as the engine would; no
engine is built and no weights are loaded."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.adapters.adapter_files import CONFIG_FILE, AdapterInfo
from slora_batch.engine.adapters.changes import AdapterChanges, adapter_changes
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.requests.grammar import GrammarService, tokenizer_info
from slora_batch.engine.requests.request import Request, Result
from slora_batch.engine.requests.scoring import scored_ids
from slora_batch.engine.requests.tokens import load_tokenizer, tokenize
from slora_batch.jobs.check import (
    JOB_ERRORS,
    JobError,
    check_job,
    check_scan,
    input_notes,
    job_error,
)
from slora_batch.jobs.column_notes import prompt_source_problem
from slora_batch.jobs.config import PROMPT_KEYS, JobConfig
from slora_batch.jobs.manifest import fingerprint, resumable_manifest
from slora_batch.jobs.openai_input import kept_columns
from slora_batch.jobs.reader import InputError, input_root, read_rows
from slora_batch.jobs.response_format import format_problem
from slora_batch.jobs.rows import to_request
from slora_batch.jobs.scan import scan_input
from slora_batch.jobs.schema import OUTPUT_COLUMNS

VALIDATE_ROWS = 200  # input rows validate_job turns into requests and tokenizes
SHOWN = 3  # problems named when no row of a job can run


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
    notes: list[str]  # input columns neither used nor kept (did you mean ...), kept columns
    broken: dict[str, str]  # adapter -> why the engine cannot run it (its rows: error rows)
    id_type: str  # the output's id column: "int64" or "string"
    position_ids: bool = False  # the input has no id column: each row's id is its position
    # what each usable adapter changes in the model, in ``adapters``' order (``changes``)
    changes: list[AdapterChanges] = field(default_factory=list)


def validate_job(job: JobConfig, limit: int | None = VALIDATE_ROWS) -> ValidationReport:
    """``check_job``, the output directory as a run finds it (rows of other inputs or settings
    are refused, as ``run`` refuses them without --overwrite), the input scan (every row is
    read once), then the Parquet schemas and the first ``limit`` rows (None: every row) turned
    into requests and tokenized as the engine would. Builds no engine and loads no weights
    (only the sample alias's one-time conversion reads its GGUF); problems of rows are reported
    (a run writes error rows for them), problems of the job raise ``JobError``: duplicate rows,
    a prompt_template naming a column the input lacks, an input without a prompt source
    (``prompt_source_problem``), and an input no checked row of can run. An eval job's input
    is built when it runs: ``slora_batch.runner.validate_job`` builds it for one that never
    ran."""
    plan = check_job(job)
    try:
        resumable_manifest(Path(job.output), job.name, job.columns, fingerprint(plan))
    except JOB_ERRORS as exc:
        raise job_error(job, exc) from exc
    fanout = plan.sweep is not None
    prompts = plan.prompts
    try:
        keep = kept_columns(job.keep_columns, plan.openai)
        scan = scan_input(
            plan.files,
            job.columns,
            keep,
            fanout,
            OUTPUT_COLUMNS,
            openai=plan.openai,
            fields=prompts.fields,
            limit=job.limit,
        )
    except InputError as exc:
        raise job_error(job, exc) from exc
    check_scan(plan, scan)  # duplicates, a template's missing column
    no_prompt = prompt_source_problem(job, scan, plan.chat_template)
    if no_prompt is not None:
        raise JobError(f"job {job.name!r}: {no_prompt}")
    problems = [
        problem
        for file in plan.files
        for problem in _schema_problems(file, job.columns, bool(prompts.templates))
    ]
    tokenizer = load_tokenizer(plan.model_path)
    grammars = GrammarService(partial(tokenizer_info, tokenizer, plan.spec))  # at a first format
    context = min(job.engine.max_model_len or plan.spec.max_context, plan.spec.max_context)
    known = None if fanout else sorted(a.name for a in plan.adapters)
    checked = bad = 0
    first = len(problems)  # the rows' problems come after the files'
    try:
        root = input_root(plan.files)
        rows = read_rows(
            plan.files,
            job.columns,
            root=root,
            openai=plan.openai,
            fields=prompts.fields,
            limit=job.limit,
            position_ids=scan.position_ids,
        )
        for row in rows:
            if checked == limit:
                break
            checked += 1
            bad += 1  # until the row proves fine
            item = to_request(row, job.sampling, fanout, prompts)
            if isinstance(item, Result):
                problems.append(item.error)
                continue
            if item.scored and (item.n or 1) > 1:  # the engine's rule: the row's own n only
                problems.append(
                    f"{row.where}: n is for generated rows, not scored ones (the row asks "
                    f"n={item.n})"
                )
                continue
            problem = _request_problem(item, known, plan.broken, tokenizer, plan.spec, context)
            problem = problem or format_problem(item, job.sampling.response_format, grammars)
            if problem:
                problems.append(f"{row.where}: {problem}")
                continue
            bad -= 1
    except InputError as exc:
        raise job_error(job, exc) from exc
    finally:
        grammars.close()
    if checked and bad == checked:  # the files' problems first: they say why for many rows
        shown = "; ".join(problems[: min(first, SHOWN - 1)] + [problems[first]])
        raise JobError(
            f"job {job.name!r}: none of the {checked:,} input rows checked can run, each would "
            f"be an error row: {shown}{_fix_hint(problems[first])}"
        )
    return ValidationReport(
        job=job.name,
        model=_model_label(plan),
        spec=plan.spec,
        adapters=plan.adapters,
        files=plan.files,
        rows_total=scan.rows,
        sweep=plan.sweep,
        rows_checked=checked,
        problems=problems,
        notes=input_notes(plan, scan),
        broken=plan.broken,
        id_type=scan.id_type,
        position_ids=scan.position_ids,
        changes=[_changes(adapter, plan.spec) for adapter in plan.adapters],
    )


def _changes(adapter: AdapterInfo, spec: ModelSpec) -> AdapterChanges:
    """What a usable adapter changes, its config read again (parsing kept none of it)."""
    cfg = json.loads((adapter.path / CONFIG_FILE).read_text())
    return adapter_changes(adapter, cfg, spec)


# what a problem says -> the key that fixes it, for the message of a job no row of runs
FIX_HINTS = (
    (
        "prompt_template",
        "prompt_template (a list of templates is tried in order: add one the rows can fill)",
    ),
    ("unknown adapter", "adapters, or the rows' adapter column"),
    ("cannot run", "adapters"),
    ("does not fit the context", "engine.max_model_len, or shorter prompts"),
    ("chat template", "apply_chat_template, or the rows' messages"),
    ("none of the columns", "columns (which input column holds the prompt), or prompt_template"),
)


def _fix_hint(problem: str) -> str:
    for phrase, key in FIX_HINTS:
        if phrase in problem:
            return f". The key to look at: {key}"
    return ""


def _model_label(plan) -> str:
    """The model's directory; for a Hub name, the name and the snapshot's commit first."""
    snap = plan.snapshots.get("model")
    if snap is None:
        return str(plan.model_path)
    return f"{snap.repo_id}@{snap.commit[:12]} ({plan.model_path})"


_ARROW_TYPES = {  # accepted column types; an all-null column (type null) is always fine
    "id": (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_null),
    "adapter": (pa.types.is_string, pa.types.is_large_string, pa.types.is_null),
    "prompt": (pa.types.is_string, pa.types.is_large_string, pa.types.is_null),
    "messages": (pa.types.is_list, pa.types.is_large_list, pa.types.is_null),
    "prompt_token_ids": (pa.types.is_list, pa.types.is_large_list, pa.types.is_null),
    "continuation": (pa.types.is_string, pa.types.is_large_string, pa.types.is_null),
    "choices": (pa.types.is_list, pa.types.is_large_list, pa.types.is_null),
    "continuation_token_ids": (pa.types.is_list, pa.types.is_large_list, pa.types.is_null),
    "choices_token_ids": (pa.types.is_list, pa.types.is_large_list, pa.types.is_null),
    "answer": (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string, pa.types.is_null),
}


def _schema_problems(file: Path, columns: dict[str, str], templated: bool) -> list[str]:
    if file.suffix.lower() != ".parquet":
        return []  # JSONL has no schema: the sample of rows covers it
    schema = pq.read_schema(file)
    prompts = [columns.get(key, key) for key in PROMPT_KEYS]
    if not templated and not any(name in schema.names for name in prompts):
        names = ", ".join(map(repr, prompts))
        return [f"{file}: none of the columns {names}: every row will be an error row"]
    problems = []
    for key, checks in _ARROW_TYPES.items():
        name = columns.get(key, key)
        if name in schema.names and not any(ok(schema.field(name).type) for ok in checks):
            problems.append(
                f"{file}: column {name!r} has type {schema.field(name).type}: "
                "its non-null values will be error rows"
            )
    return problems


def _request_problem(
    request: Request,
    known: list[str] | None,
    broken: dict[str, str],
    tokenizer,
    spec: ModelSpec,
    limit: int,
) -> str | None:
    """Why the engine would turn this request into an error row, or None."""
    if request.adapter in broken:
        return f"adapter {request.adapter!r} cannot run: {broken[request.adapter]}"
    if known is not None and request.adapter is not None and request.adapter not in known:
        # the engine's words (``prepare``): the usable adapters, and the nearest names
        near = difflib.get_close_matches(request.adapter, known, n=3, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        return f"unknown adapter {request.adapter!r} ({len(known)} adapters known{hint})"
    if tokenizer is None and request.prompt_token_ids is None:
        return "the model has no tokenizer, so prompt and messages cannot be tokenized"
    try:
        context = tokenize(request, tokenizer, spec.vocab_size, spec.path)
        continuations = []
        if request.scored:
            context, continuations = scored_ids(request, context, tokenizer, spec.vocab_size)
    except Exception as exc:  # tokenizers and chat templates raise many types
        return f"cannot tokenize: {exc}"
    n = len(context)
    if continuations:  # prefill only: the context and its longest continuation must fit
        longest = max(len(ids) for ids in continuations)
        if n + longest > limit:
            return (
                f"context of {n} tokens + a continuation of {longest} tokens does not fit the "
                f"context of {limit} tokens"
            )
        return None
    if n >= limit:
        return f"prompt of {n} tokens does not fit the context of {limit} tokens"
    return None
