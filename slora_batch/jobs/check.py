"""Checking a job before any work: ``check_job`` (model config, adapter headers, input files,
output directory, fan-out; no weights, no input rows) makes its ``JobPlan``; ``JobError`` is what
a job that cannot run raises."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from slora_batch.engine.adapters.adapter_files import (
    AdapterError,
    AdapterInfo,
    check_adapters,
    resolve_sources,
)
from slora_batch.engine.config import ConfigError
from slora_batch.engine.hub import HubError, Snapshot, locate
from slora_batch.engine.models.sample_model import ModelNotFoundError, resolve_model
from slora_batch.engine.models.spec import ModelError, ModelSpec, read_spec
from slora_batch.jobs.column_notes import NO_PROMPT, column_notes, prompt_source_problem
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.openai_input import OpenAIBatch, base_model_name, is_openai_line
from slora_batch.jobs.outdir import OutputError
from slora_batch.jobs.prompts import Prompts
from slora_batch.jobs.reader import InputError, file_records, iter_input_files, parquet_file
from slora_batch.jobs.scan import InputScan


class JobError(ValueError):
    """A job cannot run; the message names the job and the reason."""


# What a bad job raises; JobError wraps them with the job's name.
JOB_ERRORS = (
    ConfigError,
    InputError,
    AdapterError,
    ModelError,
    ModelNotFoundError,
    OutputError,
    HubError,
)


@dataclass
class JobPlan:
    """A checked job: what ``check_job`` learned without loading weights."""

    job: JobConfig
    model_path: Path
    spec: ModelSpec
    adapters: list[AdapterInfo]  # the usable ones
    broken: dict[str, str]  # adapter -> why it cannot run (its rows become error rows)
    files: list[Path]
    sweep: list[str | None] | None  # fan-out adapters (None = base), or None without fan-out
    # output rows per adapter once the input is scanned: n samples per input row (``scan``)
    rows_total: int | None = None
    input_fs: Any = None  # the pyarrow filesystem ``files`` are on; None: the local disk
    # the job's adapters with Hub names replaced by their snapshot directories (None: as the
    # job gives them): what engines, workers and Ray tasks are handed
    sources: Any = None
    snapshots: dict[str, Snapshot] = field(default_factory=dict)  # "model" / "adapter 'x'"
    openai: OpenAIBatch | None = None  # the input holds OpenAI Batch lines (``openai_input``)
    # ``manifest.fingerprint`` of this plan when taken before its run (an eval job takes it
    # while its engine starts up); None: the run takes it
    taken: dict[str, Any] | None = None
    # whether the model's tokenizer has a chat template (None: it has no tokenizer, or it could
    # not be loaded here, which the engine reports)
    chat_template: bool | None = None

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = self.job.adapters

    @property
    def prompts(self) -> Prompts:
        """The job's prompt settings (prompt_template, apply_chat_template, system_prompt)."""
        return Prompts.of(self.job)

    @property
    def total(self) -> int | None:
        """Output rows the job will have when complete (one sample of one input row for one
        adapter each; a row that fails is one error row, so the run lowers its count)."""
        return None if self.rows_total is None else self.rows_total * len(self.sweep or [None])

    def scanned(self, scan: InputScan) -> None:
        """Take the output rows per adapter from the input's scan."""
        self.rows_total = scan.samples(self.job.sampling.n)


def adapter_names(adapters: str | dict[str, str] | None) -> list[str]:
    """Names of the job's adapters, sorted, by the engine's own rule (``resolve_sources``):
    mapping keys, or every sub-directory of the adapters directory (name = folder name)."""
    try:
        return sorted(resolve_sources(adapters))
    except AdapterError as exc:
        raise ConfigError(f"adapters: {exc}") from exc


def fanout_adapters(job: JobConfig) -> list[str | None] | None:
    """The adapters every prompt runs against (None = base model), or None when not fanning out.
    "all" is the base model followed by every adapter of the job."""
    if job.fanout is None:
        return None
    try:
        names = adapter_names(job.adapters)
    except ConfigError as exc:
        raise ConfigError(f"job {job.name!r}: {exc}") from exc
    if job.fanout == "all":
        return [None, *names]
    missing = [a for a in job.fanout if a is not None and a not in names]
    if missing:
        raise ConfigError(
            f"job {job.name!r}: fanout names adapter {missing[0]!r}, not found in {job.adapters}"
        )
    return list(job.fanout)


def select_jobs(jobs: list[JobConfig], name: str | None) -> list[JobConfig]:
    """Every job, or the one called ``name``."""
    if name is None:
        return jobs
    chosen = [job for job in jobs if job.name == name]
    if not chosen:
        raise JobError(f"no job {name!r} (jobs: {', '.join(job.name for job in jobs)})")
    return chosen


def check_job(job: JobConfig, input_fs: Any = None, output: FsDir | None = None) -> JobPlan:
    """Everything that can fail a job, checked without loading weights or reading the input's
    rows. An adapter the engine cannot run does not fail the job (its rows become error rows).
    ``input_fs``: the filesystem ``job.input`` is a path on; ``output``: the output directory
    when it is not on the local disk (the Ray runner; ``fsio``)."""
    try:
        device = job.engine.device
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"engine.device is {device!r} but no CUDA device is available")
        if job.engine.data_parallel > 1 or job.engine.gpus:
            from slora_batch.engine.parallel.data_parallel import worker_slots

            worker_slots(job.engine)  # enough devices for the workers
        located = locate(job.model, job.adapters)  # every Hub name, here, once
        model_path = resolve_model(located.model)
        spec = read_spec(model_path)
        _check_tensor_parallel(job, spec)
        adapters, broken = _adapters(spec, located.adapters)
        files = iter_input_files(job.input, input_fs)
        for file in files:  # every Parquet footer: an unreadable file fails here
            if file.suffix.lower() == ".parquet":
                try:
                    parquet_file(file, input_fs).metadata  # noqa: B018
                except (OSError, pa.ArrowException) as exc:
                    raise InputError(f"{file}: cannot read as Parquet: {exc}") from exc
        sweep = fanout_adapters(job)
        names = [a.name for a in adapters] + list(broken)  # a broken one's rows: error rows
        openai = _openai(job, files, names, Path(model_path), input_fs)
        if openai is not None and job.prompt_template is not None:
            raise ConfigError(
                "prompt_template builds prompts from input columns: the input holds OpenAI Batch "
                "lines, which give their own"
            )
        chat = _chat_template(job, Path(model_path))
        if output is not None:
            if not output.is_file_or_missing():
                raise OutputError(f"output {str(output)!r} exists and is not a directory")
        elif Path(job.output).exists() and not Path(job.output).is_dir():
            raise OutputError(f"output {str(Path(job.output))!r} exists and is not a directory")
    except JOB_ERRORS as exc:
        raise job_error(job, exc) from exc
    reasons = {name: str(exc) for name, exc in broken.items()}
    return JobPlan(
        job,
        model_path,
        spec,
        adapters,
        reasons,
        files,
        sweep,
        input_fs=input_fs,
        sources=located.adapters,
        snapshots=located.snapshots,
        openai=openai,
        chat_template=chat,
    )


def _chat_template(job: JobConfig, model_path: Path) -> bool | None:
    """Whether the model's tokenizer has a chat template, read from its files as transformers
    saves them (``chat_template.jinja``, ``chat_template.json``, or the ``chat_template`` key of
    ``tokenizer_config.json``) without loading the tokenizer (transformers' import alone costs
    seconds a process); None when the model has no tokenizer files. With apply_chat_template a
    model without one fails the job."""
    config_file = model_path / "tokenizer_config.json"
    has_tokenizer = config_file.is_file() or (model_path / "tokenizer.json").is_file()
    has = (model_path / "chat_template.jinja").is_file() or (
        model_path / "chat_template.json"
    ).is_file()
    if not has and config_file.is_file():
        try:
            settings = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            if job.apply_chat_template:
                raise ModelError(
                    f"apply_chat_template: model {job.model!r}: cannot read {config_file}: {exc}"
                ) from exc
            return None
        has = isinstance(settings, dict) and bool(settings.get("chat_template"))
    if job.apply_chat_template and not has:
        what = "has no chat template" if has_tokenizer else "has no tokenizer"
        raise ConfigError(
            f"apply_chat_template: model {job.model!r} ({model_path}) {what}, so prompts cannot "
            "be sent as chat turns. Set apply_chat_template: false and write the model's prompt "
            "format in prompt_template, or use a model that ships a chat template"
        )
    return has if has_tokenizer else None


def _check_tensor_parallel(job: JobConfig, spec: ModelSpec) -> None:
    """What the engine refuses at once under ``tensor_parallel``: a model whose heads or sizes
    it does not divide, and more ranks than visible CUDA devices when it runs on CUDA."""
    size = job.engine.tensor_parallel
    if size == 1:
        return
    spec.shard(size)  # ModelError naming the sizes that do not divide
    if job.engine.device == "cpu" or job.engine.data_parallel > 1 or job.engine.gpus:
        return  # gloo ranks on the CPU; data-parallel slots are worker_slots' to count
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < size:
        raise ConfigError(
            f"engine.tensor_parallel is {size} but {torch.cuda.device_count()} CUDA devices "
            "are visible"
        )


def _adapters(spec: ModelSpec, sources) -> tuple[list[AdapterInfo], dict[str, AdapterError]]:
    """``check_adapters``; a missing adapters directory is the job's error, said as such."""
    if isinstance(sources, str | Path) and not Path(sources).is_dir():
        what = "is not a directory" if Path(sources).exists() else "does not exist"
        raise ConfigError(
            f"adapters directory {str(sources)!r} {what} (adapters: a directory of PEFT adapter "
            "directories, or a mapping {name: path})"
        )
    return check_adapters(spec, sources)


def check_scan(plan: JobPlan, scan: InputScan, after: str = "") -> None:
    """Refuse a job its input scan shows cannot run as asked: rows whose (id, adapter) repeat,
    a prompt_template naming a column the input does not have. ``after``: the message's end."""
    job = plan.job
    if scan.duplicates:
        raise JobError(f"job {job.name!r}: {scan.duplicates_message()}{after}")
    present = list(scan.column_kinds)
    missing = [name for name in plan.prompts.fields if name not in present]
    if missing and (present or scan.rows):
        close = difflib.get_close_matches(missing[0], present, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise JobError(
            f"job {job.name!r}: prompt_template names column {missing[0]!r}, which the input "
            f"does not have (its columns: {', '.join(present) or 'none'}){hint}{after}"
        )


CHAT_NOTE = "the model has a chat template"  # how the raw-prompt note starts (``loud``)
LOUD_NOTES = ("OpenAI batch", CHAT_NOTE, NO_PROMPT)  # notes a run logs as warnings too


def chat_note(plan: JobPlan, scan: InputScan) -> str | None:
    """A note when text prompts go to a model with a chat template as raw text (the prompt
    column, or prompt_template's, without apply_chat_template): a chat model often answers a
    raw text with its end of turn at once, an empty output."""
    job = plan.job
    if not plan.chat_template or job.apply_chat_template:
        return None
    column = job.columns["prompt"]
    if job.prompt_template is not None:
        what = "prompt_template's prompts go"
    elif scan.column_kinds.get(column, "null") != "null":
        what = f"the prompts of column {column!r} go"
    else:
        return None
    system = " (and system_prompt, which applies to chat turns only)" if job.system_prompt else ""
    return (
        f"{CHAT_NOTE}, but {what} to it as raw text, which a chat model often answers with an "
        f"empty output: set apply_chat_template: true to send each as a user turn through "
        f"the template{system}"
    )


def input_notes(plan: JobPlan, scan: InputScan) -> list[str]:
    """The scan's notes on the input's columns, the raw-prompt note (``chat_note``), an input
    without a prompt column (``prompt_source_problem``), and a warning when it has no row."""
    notes = column_notes(scan, plan.job.columns, plan.prompts.fields)
    for note in (chat_note(plan, scan), prompt_source_problem(plan.job, scan, plan.chat_template)):
        if note is not None:
            notes.insert(0, note)
    if scan.rows == 0:
        files = ", ".join(str(f) for f in plan.files[:3]) + (" ..." if len(plan.files) > 3 else "")
        notes.insert(
            0, f"the input has no rows ({len(plan.files)} file(s): {files}): nothing to run"
        )
    return notes


def job_error(job: JobConfig, exc: Exception) -> JobError:
    message = str(exc)
    return JobError(message if f"job {job.name!r}" in message else f"job {job.name!r}: {message}")


def _openai(
    job: JobConfig, files: list[Path], adapters: list[str], model_dir: Path, fs: Any = None
) -> OpenAIBatch | None:
    """The job's OpenAI Batch reading, or None for plain rows: ``input_format: openai``, or
    ``auto`` when every file is JSONL and the first line of the first is an OpenAI Batch line.
    Raises ``InputError`` for an openai input with a Parquet file, ``ConfigError`` with fanout."""
    jsonl = all(str(f).lower().endswith(".jsonl") for f in files)
    if job.input_format == "rows" or (job.input_format == "auto" and not jsonl):
        return None
    if not jsonl:
        parquet = next(f for f in files if not str(f).lower().endswith(".jsonl"))
        raise InputError(f"input_format openai reads .jsonl files only, got {str(parquet)!r}")
    if job.input_format == "auto":
        first = next(iter(file_records(files[0], None, fs)), None) if files else None
        if first is None or not is_openai_line(first[1]):
            return None
    if job.fanout is not None:
        raise ConfigError("input_format openai names each line's adapter (body.model): no fanout")
    name = base_model_name(job.model)
    bases = {name, name.rsplit("/", 1)[-1], job.model, Path(model_dir).name}
    return OpenAIBatch(bases, adapters, job.columns)
