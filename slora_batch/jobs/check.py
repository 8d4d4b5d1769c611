"""Checking a job: ``check_job`` (model config, adapter headers, input files, output
directory, fan-out; no weights, no input rows) makes its ``JobPlan`` before any work; once the
input is scanned, ``check_scan`` refuses what the scan shows cannot run and ``input_notes`` says
what a user should hear about the input. ``JobError`` is what a job that cannot run raises."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slora_batch.engine.adapters.adapter_files import (
    AdapterError,
    AdapterInfo,
    check_adapters,
    fp8_refusals,
    resolve_sources,
)
from slora_batch.engine.config import ConfigError, EngineConfig
from slora_batch.engine.hub import HubError, Snapshot, locate
from slora_batch.engine.models.sample_model import ModelNotFoundError, resolve_model
from slora_batch.engine.models.spec import ModelError, ModelSpec, read_spec
from slora_batch.jobs.column_notes import NO_PROMPT, column_notes, prompt_source_problem
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.openai_input import OpenAIBatch, openai_batch
from slora_batch.jobs.outdir import OutputError
from slora_batch.jobs.prompts import Prompts
from slora_batch.jobs.reader import InputError, first_record, input_files
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
        """Take the output rows per adapter from the input's scan: the job's n for each row,
        but a row's own for the rows that have one (``InputScan.own_n_rows``), when every row
        that can be read makes its samples (one that fails makes one error row instead).

        Running example: 10 rows, 2 of them with n 5 and one line unreadable, a job with n 3:
        (10 - 3) * 3 + 5 + 5 + 1 = 32."""
        n = self.job.sampling.n
        self.rows_total = (scan.rows - scan.own_n_rows) * n + scan.own_n_samples


def select_jobs(jobs: list[JobConfig], name: str | None) -> list[JobConfig]:
    """Every job, or the one called ``name``."""
    if name is None:
        return jobs
    chosen = [job for job in jobs if job.name == name]
    if not chosen:
        raise JobError(f"no job {name!r} (jobs: {', '.join(job.name for job in jobs)})")
    return chosen


def job_error(job: JobConfig, exc: Exception) -> JobError:
    message = str(exc)
    return JobError(message if f"job {job.name!r}" in message else f"job {job.name!r}: {message}")


def check_job(job: JobConfig, input_fs: Any = None, output: FsDir | None = None) -> JobPlan:
    """Everything that can fail a job, checked without loading weights or reading the input's
    rows, in this order: the devices, the model (its config, its shards under
    tensor_parallel, its chat template), the output directory, the adapters and the fan-out,
    the input files and their format. An adapter the engine cannot run does not fail the
    job (its rows become error rows). ``input_fs``: the filesystem ``job.input`` is a path on;
    ``output``: the output directory when it is not on the local disk (the Ray runner;
    ``fsio``)."""
    engine = job.engine
    try:
        _check_device(engine)
        located = locate(job.model, job.adapters)  # every Hub name, here, once
        model_path = resolve_model(located.model)
        spec = read_spec(model_path)
        if engine.tensor_parallel > 1:
            spec.shard(engine.tensor_parallel)  # ModelError naming the sizes that do not divide
        _check_tensor_parallel_devices(engine)
        chat = _chat_template(model_path, job.model, job.apply_chat_template)
        _check_output(job.output, output)
        not_openai = _openai_refusal(job)
        _check_adapters_dir(located.adapters)
        sweep = fanout_adapters(job)
        adapters, broken = check_adapters(spec, located.adapters)
        if engine.adapter_dtype == "fp8":  # as the engine's store refuses them
            broken.update(fp8_refusals(adapters))
            adapters = [a for a in adapters if a.name not in broken]
        files = input_files(job.input, input_fs)
        first = first_record(files, input_fs)
        openai = openai_batch(
            job.input_format,
            files,
            first,
            model=job.model,
            model_dir=model_path,
            adapters=[a.name for a in adapters] + list(broken),  # a broken one's: error rows
            columns=job.columns,
        )
        if openai is not None and not_openai is not None:
            raise ConfigError(not_openai)
    except JOB_ERRORS as exc:
        raise job_error(job, exc) from exc
    return JobPlan(
        job,
        model_path,
        spec,
        adapters,
        {name: str(exc) for name, exc in broken.items()},
        files,
        sweep,
        input_fs=input_fs,
        sources=located.adapters,
        snapshots=located.snapshots,
        openai=openai,
        chat_template=chat,
    )


def _check_device(engine: EngineConfig) -> None:
    """The engine's device is there: CUDA when it names one, and enough devices for its
    data-parallel workers."""
    if engine.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"engine.device is {engine.device!r} but no CUDA device is available")
    if engine.data_parallel > 1 or engine.gpus:
        from slora_batch.engine.parallel.data_parallel import worker_slots

        worker_slots(engine)  # enough devices for the workers


def _check_tensor_parallel_devices(engine: EngineConfig) -> None:
    """Under ``tensor_parallel`` on CUDA, no more ranks than visible CUDA devices (gloo ranks
    run on the CPU; data-parallel slots are ``worker_slots``' to count)."""
    size = engine.tensor_parallel
    if size == 1 or engine.device == "cpu" or engine.data_parallel > 1 or engine.gpus:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < size:
        raise ConfigError(
            f"engine.tensor_parallel is {size} but {torch.cuda.device_count()} CUDA devices "
            "are visible"
        )


def _chat_template(model_path: Path, model: str, required: bool) -> bool | None:
    """Whether the model's tokenizer has a chat template, read from its files as transformers
    saves them (``chat_template.jinja``, ``chat_template.json``, or the ``chat_template`` key of
    ``tokenizer_config.json``) without loading the tokenizer (transformers' import alone costs
    seconds a process); None when the model has no tokenizer files. ``required``
    (apply_chat_template): a model without one fails the job, named as the job names it
    (``model``)."""
    config_file = model_path / "tokenizer_config.json"
    has_tokenizer = config_file.is_file() or (model_path / "tokenizer.json").is_file()
    has = (model_path / "chat_template.jinja").is_file() or (
        model_path / "chat_template.json"
    ).is_file()
    if not has and config_file.is_file():
        try:
            settings = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            if required:
                raise ModelError(
                    f"apply_chat_template: model {model!r}: cannot read {config_file}: {exc}"
                ) from exc
            return None
        has = isinstance(settings, dict) and bool(settings.get("chat_template"))
    if required and not has:
        what = "has no chat template" if has_tokenizer else "has no tokenizer"
        raise ConfigError(
            f"apply_chat_template: model {model!r} ({model_path}) {what}, so prompts cannot "
            "be sent as chat turns. Set apply_chat_template: false and write the model's prompt "
            "format in prompt_template, or use a model that ships a chat template"
        )
    return has if has_tokenizer else None


def _check_adapters_dir(sources: Any) -> None:
    """A directory of adapters is there: its absence is the job's error, said as such."""
    if isinstance(sources, str | Path) and not Path(sources).is_dir():
        what = "is not a directory" if Path(sources).exists() else "does not exist"
        raise ConfigError(
            f"adapters directory {str(sources)!r} {what} (adapters: a directory of PEFT adapter "
            "directories, or a mapping {name: path})"
        )


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


def _openai_refusal(job: JobConfig) -> str | None:
    """Why the job cannot read OpenAI Batch lines, or None: they name each line's adapter
    (no fanout) and give their own prompts (no prompt_template)."""
    if job.fanout is not None:
        return "input_format openai names each line's adapter (body.model): no fanout"
    if job.prompt_template is not None:
        return (
            "prompt_template builds prompts from input columns: the input holds OpenAI Batch "
            "lines, which give their own"
        )
    return None


def _check_output(path: str, output: FsDir | None) -> None:
    """The output directory is a directory, or not there yet (``output``: it, on another
    filesystem; else ``path`` on the local disk)."""
    if output is not None:
        if not output.is_file_or_missing():
            raise OutputError(f"output {str(output)!r} exists and is not a directory")
    elif Path(path).exists() and not Path(path).is_dir():
        raise OutputError(f"output {str(Path(path))!r} exists and is not a directory")


def check_scan(plan: JobPlan, scan: InputScan, after: str = "") -> None:
    """Refuse a job its input scan shows cannot run as asked: rows whose (id, adapter) repeat,
    a prompt_template naming a column the input does not have. ``after``: the message's end."""
    name = plan.job.name
    if scan.duplicates:
        raise JobError(f"job {name!r}: {scan.duplicates_message()}{after}")
    present = list(scan.column_kinds)
    missing = [column for column in plan.prompts.fields if column not in present]
    if missing and (present or scan.rows):
        close = difflib.get_close_matches(missing[0], present, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise JobError(
            f"job {name!r}: prompt_template names column {missing[0]!r}, which the input "
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
    """A warning when the input has no row (first: a run logs it), an input without a prompt
    column (``prompt_source_problem``), the raw-prompt note (``chat_note``), then the scan's
    notes on the input's columns (``column_notes``)."""
    job = plan.job
    empty = _no_rows_note(plan.files) if scan.rows == 0 else None
    chat = chat_note(plan, scan)
    no_prompt = prompt_source_problem(job, scan, plan.chat_template)
    notes = column_notes(scan, job.columns, plan.prompts.fields)
    return [note for note in (empty, no_prompt, chat) if note is not None] + notes


def _no_rows_note(files: list[Path]) -> str:
    shown = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    return f"the input has no rows ({len(files)} file(s): {shown}): nothing to run"
