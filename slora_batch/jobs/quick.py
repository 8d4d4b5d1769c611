"""A one-file job from command-line flags, as vLLM's ``run-batch`` takes its file:
``slora-batch run data.jsonl --model M --adapters a=PATH,b=PATH --output OUT``.

The flags become one job mapping, which goes through the job file's own checks
(``config.job_from_mapping``): a flag's value is wrong exactly when the same key in a job file
would be. Relative paths are against the current directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slora_batch.engine.config import ConfigError
from slora_batch.jobs.config import JobConfig, job_from_mapping

JOB_FILE_SUFFIXES = (".yaml", ".yml")
WHERE = "command line"


def is_job_file(path: str) -> bool:
    """A job file (YAML) by its suffix; anything else is a one-file job's input."""
    return path.lower().endswith(JOB_FILE_SUFFIXES)


@dataclass
class QuickFlags:
    """The one-file job's flags as given; None (or empty) is a flag not given, whose job key
    keeps the job's default."""

    model: str | None = None
    adapters: list[str] = field(default_factory=list)  # "DIR", or "name=path,name=path"
    output: str | None = None
    name: str | None = None
    fanout: str | None = None  # "all", or adapter names "a,b" ("null": the base model)
    max_new_tokens: int | None = None
    temperature: float | None = None
    prompt_template: str | None = None
    apply_chat_template: bool = False
    system_prompt: str | None = None
    columns: list[str] = field(default_factory=list)  # "key=input column", e.g. prompt=question
    keep_columns: str | None = None  # "all" or "a,b"
    output_format: str | None = None
    limit: int | None = None
    engine: list[str] = field(default_factory=list)  # "key=value" of the engine mapping
    sampling: list[str] = field(default_factory=list)  # "key=value" of the sampling mapping

    def given(self) -> list[str]:
        """The flags given, by their command-line names (``--limit`` is not one-file only)."""
        return [
            "--" + key.replace("_", "-")
            for key, value in vars(self).items()
            if key != "limit" and value not in (None, False, [])
        ]


def quick_job(input_path: str, flags: QuickFlags, base_dir: Path | None = None) -> JobConfig:
    """The one job of ``slora-batch run INPUT --model M --output OUT [flags]``."""
    missing = [f"--{key}" for key in ("model", "output") if getattr(flags, key) is None]
    if missing:
        raise ConfigError(
            f"{input_path!r} is not a job file ({'/'.join(JOB_FILE_SUFFIXES)}), so it is the "
            f"input of a one-file job, which needs {' and '.join(missing)} (e.g. slora-batch run "
            f"{input_path} --model MODEL --output OUT)"
        )
    raw: dict[str, Any] = {
        "name": flags.name or Path(flags.output).name or "job",
        "model": flags.model,
        "input": input_path,
        "output": flags.output,
        **_job_keys(flags),
        **_settings(flags),
    }
    return job_from_mapping(raw, base_dir or Path.cwd(), WHERE)


def _job_keys(flags: QuickFlags) -> dict[str, Any]:
    """The job keys the flags give (adapters, fanout, columns, keep_columns, the prompt keys,
    output_format, limit), as a job file writes them."""
    raw: dict[str, Any] = {}
    if flags.adapters:
        raw["adapters"] = _adapters(flags.adapters)
    if flags.fanout is not None:
        raw["fanout"] = "all" if flags.fanout == "all" else _names(flags.fanout, "--fanout")
    if flags.columns:
        raw["columns"] = _pairs(flags.columns, "--column", parse=False)
    if flags.keep_columns is not None:
        keep = flags.keep_columns
        raw["keep_columns"] = "all" if keep == "all" else _names(keep, "--keep-columns")
    for key in ("prompt_template", "system_prompt", "output_format", "limit"):
        if getattr(flags, key) is not None:
            raw[key] = getattr(flags, key)
    if flags.apply_chat_template:
        raw["apply_chat_template"] = True
    return raw


def _settings(flags: QuickFlags) -> dict[str, Any]:
    """The sampling and engine mappings the flags give: ``--sampling key=value``, with
    ``--max-new-tokens`` and ``--temperature`` over them, and ``--engine key=value``."""
    raw: dict[str, Any] = {}
    sampling = _pairs(flags.sampling, "--sampling")
    for key in ("max_new_tokens", "temperature"):
        if getattr(flags, key) is not None:
            sampling[key] = getattr(flags, key)
    if sampling:
        raw["sampling"] = sampling
    if flags.engine:
        raw["engine"] = _pairs(flags.engine, "--engine")
    return raw


def _adapters(values: list[str]) -> str | dict[str, str]:
    """``--adapters DIR`` (every sub-directory an adapter) or ``--adapters a=PATH,b=PATH``
    (repeatable): a directory, or {name: path or Hub name}."""
    items = [item.strip() for value in values for item in value.split(",") if item.strip()]
    pairs = [item for item in items if "=" in item]
    if not pairs and len(items) == 1:
        return items[0]
    if len(pairs) != len(items):
        raise ConfigError(
            f"--adapters: give one directory of adapters, or name=path pairs (a=PATH,b=PATH), "
            f"got {', '.join(items)!r}"
        )
    return _pairs(pairs, "--adapters", parse=False)


def _pairs(values: list[str], flag: str, parse: bool = True) -> dict[str, Any]:
    """ "key=value" items into a mapping; with ``parse`` a value reads as YAML (``4096`` an
    integer, ``true`` a boolean), as in a job file."""
    mapping: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag}: expected key=value, got {item!r}")
        key = key.strip()
        if key in mapping:
            raise ConfigError(f"{flag}: {key!r} given twice")
        mapping[key] = _yaml_value(value) if parse else value
    return mapping


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def _names(text: str, flag: str) -> list[str | None]:
    """Comma-separated names; "null" is the base model (as in a job file)."""
    names = [None if name.strip() in ("null", "~") else name.strip() for name in text.split(",")]
    if "" in names:
        raise ConfigError(f"{flag}: an empty name in {text!r}")
    return names
