"""Jobs: what to run (model, adapters, input, output) and how, loaded strictly from YAML.

A job file has an optional ``defaults`` mapping merged under every entry of ``jobs``; the nested
``sampling``, ``engine`` and ``columns`` mappings merge key by key, every other key is replaced.
Unknown keys at any level raise ``ConfigError`` naming the file, the job and the key.

Base-model convention: wherever an adapter name is expected (input rows, ``fanout`` lists), null
or "" means the base model. "base" is an ordinary adapter name.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slora_batch.engine.config import ConfigError, EngineConfig, SamplingConfig, check, from_dict
from slora_batch.engine.requests.request import SAMPLING_FIELDS
from slora_batch.jobs.eval_keys import EvalConfig, eval_job_raw
from slora_batch.jobs.prompts import check_prompt_keys
from slora_batch.jobs.response_format import read_schema_file

MODEL_ALIAS = "smollm2-135m-instruct"  # the built-in sample model; never treated as a path
SCORE_KEYS = ("continuation", "choices", "continuation_token_ids", "choices_token_ids")
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")  # a row gives one of them
# input columns the ``columns`` mapping may rename; a key added later maps to itself by default
COLUMN_KEYS = ("id", "adapter", "prompt", "messages", "prompt_token_ids", *SCORE_KEYS, "answer")
ROW_OPTIONS = (*SAMPLING_FIELDS, "logprobs")  # per-row options, read under their own names
URI_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+://")  # a path with a scheme, kept as given
FORMATS = {"input_format": ("auto", "rows", "openai"), "output_format": ("parquet", "openai")}
NESTED = {"sampling": SamplingConfig, "engine": EngineConfig}


@dataclass(kw_only=True)
class JobConfig:
    """One job. Paths are absolute after ``load_jobs`` (relative to the job file)."""

    name: str  # the job's name (`--job NAME` runs it alone); in a job file: the file's stem and
    # the job's index (`jobs-0`) when not given
    model: str  # a model directory, a Hub name "org/name[@rev]", or "smollm2-135m-instruct"
    # a dir of PEFT adapter dirs, or {name: path or Hub name "org/name[@revision]"}
    adapters: str | dict[str, str] | None = None
    input: str  # a .jsonl/.parquet file, a directory of them, or a glob
    output: str  # output directory: Parquet parts, _stats.parquet, _job.json, _SUCCESS
    # the input column that holds each row field, for files that name them otherwise
    columns: dict[str, str] = field(default_factory=lambda: {k: k for k in COLUMN_KEYS})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how tokens are drawn
    engine: EngineConfig = field(default_factory=EngineConfig)  # device, dtype, memory, parallelism
    # every input row through each of these adapters, its own adapter column not read: "all" (the
    # base model and every adapter) or a list of names (null = base); None: a row names its own
    fanout: str | list[str | None] | None = None
    window: int = 8192  # rows sorted together by adapter, then prompt (shared prefixes meet)
    part_rows: int = 4096  # rows per output part file
    part_seconds: float = 30.0  # a part is committed at least this often: what kill -9 can lose
    # input columns carried to the output, or "all" (every one but the id and adapter columns);
    # one named as an output column is kept as "input_<name>"
    keep_columns: str | list[str] | None = None
    # each row's prompt from its columns, str.format style: "{instruction}\n\n{input}"; or a
    # list of templates, each row taking the first whose columns are all non-empty
    prompt_template: str | list[str] | None = None
    apply_chat_template: bool = False  # each text prompt sent as a user turn of the chat template
    # a system turn before each text prompt's user turn, and first in messages rows without one
    system_prompt: str | None = None
    limit: int | None = None  # run only the first N input rows (before fan-out); null: all
    # what each choice index means, for the preference table's columns (the sample eval: one
    # style per position); None: the choices' texts when every row has the same, else indices
    choice_labels: list[str] | None = None
    # "rows": a row per JSONL line or Parquet row; "openai": OpenAI Batch API lines
    # (``openai_input.py``); "auto": openai when the first line of a JSONL input has custom_id
    # and body, else rows
    input_format: str = "auto"
    output_format: str = "parquet"  # "openai": also _openai_output.jsonl, _openai_errors.jsonl
    eval: EvalConfig | None = None  # lm-eval tasks in place of ``input`` (``jobs/eval_keys.py``)

    def __post_init__(self) -> None:
        for name in ("name", "model", "input", "output"):
            value = getattr(self, name)
            check(
                isinstance(value, str) and value != "",
                f"{name} must be a non-empty string, got {value!r}",
            )
        check(
            self.adapters is None or isinstance(self.adapters, str | Mapping),
            f"adapters must be a directory, a mapping {{name: path}} or null, got {self.adapters!r}",
        )
        if isinstance(self.adapters, Mapping):
            for key, value in self.adapters.items():
                check(
                    isinstance(key, str) and key != "" and isinstance(value, str) and value != "",
                    f"adapters: names and paths must be non-empty strings, got {key!r}: {value!r}",
                )
            self.adapters = dict(self.adapters)
        check(isinstance(self.columns, Mapping), f"columns must be a mapping, got {self.columns!r}")
        unknown = sorted(set(self.columns) - set(COLUMN_KEYS))
        check(not unknown, f"columns: unknown key {unknown[0] if unknown else ''!r}")
        self.columns = {key: self.columns.get(key, key) for key in COLUMN_KEYS}
        for key, value in self.columns.items():
            check(
                isinstance(value, str) and value != "",
                f"columns.{key} must be a non-empty string, got {value!r}",
            )
        check(
            len(set(self.columns.values())) == len(COLUMN_KEYS),
            f"columns map two keys to one input column: {self.columns}",
        )
        check(isinstance(self.sampling, SamplingConfig), "sampling must be a SamplingConfig")
        check(isinstance(self.engine, EngineConfig), "engine must be an EngineConfig")
        for name in ("window", "part_rows"):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name} must be an integer >= 1, got {value!r}",
            )
        check(
            isinstance(self.part_seconds, int | float)
            and not isinstance(self.part_seconds, bool)
            and self.part_seconds > 0,
            f"part_seconds must be a number > 0, got {self.part_seconds!r}",
        )
        self.part_seconds = float(self.part_seconds)
        self.fanout = _check_fanout(self.fanout, self.adapters)
        self.keep_columns = _check_keep(self.keep_columns, self.columns)
        check_prompt_keys(self)
        labels = self.choice_labels
        check(
            labels is None
            or (
                isinstance(labels, list)
                and labels
                and all(isinstance(x, str) and x.strip() for x in labels)
            ),
            f"choice_labels must be a non-empty list of non-empty strings, got {labels!r}",
        )
        for name, allowed in FORMATS.items():
            value = getattr(self, name)
            check(value in allowed, f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        limit = self.limit
        ok = limit is None or (type(limit) is int and limit >= 1)  # bool is no int here
        check(ok, f"limit must be an integer >= 1 or null, got {limit!r}")
        check(
            limit is None or self.eval is None,
            "limit is for input rows: an eval job takes eval.limit",
        )


def _check_fanout(
    fanout: Any, adapters: str | dict[str, str] | None
) -> str | list[str | None] | None:
    if fanout is None or fanout == "all":
        return fanout
    ok = (
        isinstance(fanout, list) and fanout and all(a is None or isinstance(a, str) for a in fanout)
    )
    check(
        ok,
        f"fanout must be null, 'all' or a non-empty list of adapter names (null = base), got {fanout!r}",
    )
    names = [a or None for a in fanout]
    check(len(set(names)) == len(names), f"fanout lists an adapter twice: {fanout!r}")
    for name in names:
        check(
            name is None or adapters is not None,
            f"fanout names adapter {name!r} but the job has no adapters",
        )
        check(
            name is None or not isinstance(adapters, dict) or name in adapters,
            f"fanout names adapter {name!r}, which is not in adapters ({', '.join(sorted(adapters or ()))})",
        )
    return names


def _check_keep(keep: Any, columns: dict[str, str]) -> str | list[str] | None:
    """Any input column but the id and adapter ones (``scan.kept_name`` renames a clash)."""
    if keep is None or keep == "all":
        return keep
    check(
        isinstance(keep, list) and keep != [] and all(isinstance(k, str) and k for k in keep),
        f"keep_columns must be 'all' or a non-empty list of input column names, got {keep!r}",
    )
    check(len(set(keep)) == len(keep), f"keep_columns lists a column twice: {keep!r}")
    for name in keep:
        check(
            name not in (columns["id"], columns["adapter"]),
            f"keep_columns: {name!r} is the id or adapter column, already in the output",
        )
    return list(keep)


def prompt_keys(job: JobConfig) -> dict[str, Any]:
    """The prompt keys a job sets (they change its rows), for its fingerprint: only those set,
    so the fingerprint of a job without them is what it was before they existed."""
    keys = ("prompt_template", "apply_chat_template", "system_prompt")
    return {key: getattr(job, key) for key in keys if getattr(job, key)}


def load_jobs(path: str | Path) -> list[JobConfig]:
    """Read a job file; every job validated, paths resolved against the file's directory."""
    path = Path(path)
    defaults, jobs = _job_file(path)
    unknown = _unknown_keys(defaults, f"{path.name}: defaults")
    for index, raw in enumerate(jobs):
        unknown += _unknown_keys(
            raw, f"{path.name}: job {raw.get('name') or f'{path.stem}-{index}'!r}"
        )
    if unknown:  # every one at once: a user fixes them all in one edit
        raise ConfigError("; ".join(unknown))
    base_dir = path.resolve().parent
    result: list[JobConfig] = []
    for index, raw in enumerate(jobs):
        name = raw.get("name") or f"{path.stem}-{index}"
        where = f"{path.name}: job {name!r}"
        result.append(_build(_merge(defaults, raw), name, base_dir, where))
    _check_distinct(result, path.name)
    return result


def _job_file(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job file's ``defaults`` mapping and ``jobs`` list of mappings, as YAML gives them."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job file: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path.name}: expected a mapping with a 'jobs' list, got {type(data).__name__}"
        )
    _reject_unknown(data, {"defaults", "jobs"}, f"{path.name}: unknown top-level key")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path.name}: defaults must be a mapping, got {type(defaults).__name__}")
    jobs = data.get("jobs")
    if not isinstance(jobs, list) or not jobs:
        raise ConfigError(f"{path.name}: 'jobs' must be a non-empty list of job mappings")
    if "name" in defaults:
        raise ConfigError(f"{path.name}: defaults cannot set 'name' (every job needs its own)")
    for index, raw in enumerate(jobs):
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path.name}: job {index} must be a mapping, got {type(raw).__name__}"
            )
    return defaults, jobs


def _check_distinct(jobs: list[JobConfig], file: str) -> None:
    """Two jobs of one file never share a name or an output directory."""
    for key in ("name", "output"):
        seen: dict[str, str] = {}
        for job in jobs:
            value = getattr(job, key)
            if value in seen:
                raise ConfigError(
                    f"{file}: jobs {seen[value]!r} and {job.name!r} have the same {key} {value!r}"
                )
            seen[value] = job.name


def job_from_mapping(raw: dict[str, Any], base_dir: str | Path, where: str) -> JobConfig:
    """One job from a mapping of job keys (the command line's one-file job), checked as
    ``load_jobs`` checks an entry of a job file; relative paths are against ``base_dir``."""
    unknown = _unknown_keys(raw, where)
    if unknown:
        raise ConfigError("; ".join(unknown))
    return _build(raw, raw.get("name"), Path(base_dir).resolve(), where)


def _unknown_keys(raw: dict[str, Any], where: str) -> list[str]:
    """A message for every unknown key of a job (or defaults) mapping, nested ones included."""
    known = {f.name for f in dataclasses.fields(JobConfig)}
    messages = _unknown(raw, known, f"{where}: unknown key")
    for key, cls in (*NESTED.items(), ("columns", None)):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a mapping, got {type(value).__name__}")
        names = set(COLUMN_KEYS) if cls is None else {f.name for f in dataclasses.fields(cls)}
        messages += _unknown(value, names, f"{where}: unknown key", f" in {key}")
    return messages


def _reject_unknown(data: dict[str, Any], known: set[str], prefix: str, suffix: str = "") -> None:
    unknown = _unknown(data, known, prefix, suffix)
    if unknown:
        raise ConfigError("; ".join(unknown))


def _unknown(data: dict[str, Any], known: set[str], prefix: str, suffix: str = "") -> list[str]:
    """ "<prefix> 'key'<suffix> (did you mean ...?)" for each key of ``data`` not in ``known``."""
    messages = []
    for key in sorted(set(data) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = (
            f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
        )
        messages.append(f"{prefix} {key!r}{suffix}{hint}")
    return messages


def _merge(defaults: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    merged = {**defaults, **job}
    for key in (*NESTED, "columns"):
        if isinstance(defaults.get(key), dict) and isinstance(job.get(key), dict):
            merged[key] = {**defaults[key], **job[key]}
    return merged


def _build(raw: dict[str, Any], name: str, base_dir: Path, where: str) -> JobConfig:
    raw = {**raw, "name": name}
    if raw.get("eval") is not None:
        raw = eval_job_raw(raw, base_dir, where)
    for key in ("input", "output"):
        if key not in raw:
            raise ConfigError(f"{where}: missing required key {key!r}")
    if "model" not in raw:
        raise ConfigError(
            f"{where}: missing required key 'model' (set it in the job or in defaults)"
        )
    for key in ("input", "output"):
        raw[key] = _resolve(raw[key], base_dir, key, where)
    if isinstance(raw.get("adapters"), str):
        raw["adapters"] = _resolve(raw["adapters"], base_dir, "adapters", where)
    elif isinstance(raw.get("adapters"), dict):
        raw["adapters"] = {  # a Hub name ("org/name[@rev]") no local path shadows stays
            k: v if _hub_name(v, base_dir) else _resolve(v, base_dir, f"adapters.{k}", where)
            for k, v in raw["adapters"].items()
        }
    if isinstance(raw["model"], str) and _looks_like_path(raw["model"], base_dir):
        raw["model"] = _resolve(raw["model"], base_dir, "model", where)
    raw["sampling"] = read_schema_file(raw.get("sampling"), base_dir, where)
    for key, cls in NESTED.items():
        try:
            raw[key] = from_dict(cls, raw.get(key), f"{where}: {key}")
        except ConfigError as exc:  # __post_init__ range checks do not name the job
            raise ConfigError(
                exc.args[0] if str(exc).startswith(where) else f"{where}: {key}: {exc}"
            ) from exc
    try:
        return JobConfig(**raw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _looks_like_path(model: str, base_dir: Path) -> bool:
    """The alias and Hub names ("org/name[@revision]", resolved by ``check_job``) stay as
    written; anything absolute, starting with "." or "~", or existing relative to the job file
    is a path."""
    if model == MODEL_ALIAS:
        return False
    return model.startswith((".", "/", "~")) or (base_dir / model).exists()


def _hub_name(value: Any, base_dir: Path) -> bool:
    """A Hub name (``hub.hub_candidate``) with no path of that name relative to the job file."""
    from slora_batch.engine.hub import hub_candidate

    return hub_candidate(value) and not (base_dir / value).exists()


def _resolve(value: Any, base_dir: Path, key: str, where: str) -> str:
    if not isinstance(value, str) or value == "":
        raise ConfigError(f"{where}: {key} must be a non-empty string path, got {value!r}")
    if URI_RE.match(value):  # file://, s3://, gs://: for the Ray runner, which reads them
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base_dir / path)
