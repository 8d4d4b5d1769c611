"""A job's ``eval:`` section: lm-eval tasks in place of input rows, as the job file gives them.

An eval job's input is the file of lm-eval's requests that the sweep (``slora_batch.eval``)
writes into its output directory (``REQUESTS_FILE``), fanned out over the base model and the
adapters (``fanout: all`` unless the job names its own list), so the job machinery (parts,
resume) runs it like any job. The keys are a part of the job file, loaded without lm-eval:
here, beside ``config.py``, and the sweep reads them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slora_batch.engine.config import ConfigError, check, from_dict

REQUESTS_FILE = "_eval_requests.jsonl"  # "_": dataset readers of the output skip it


@dataclass
class EvalConfig:
    """lm-eval tasks by name (``include_path``: a directory of task YAMLs); ``num_fewshot`` and
    ``limit`` (docs per task, or a fraction) as lm-eval's ``simple_evaluate`` takes them."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task (or group) names
    include_path: str | None = None  # a directory of task YAMLs (relative to the job file)
    num_fewshot: int | None = None  # few-shot examples per prompt; None: each task's own
    limit: int | float | None = None  # docs per task, or a fraction of them; None: every doc
    bootstrap_iters: int = 100000  # lm-eval's stderr bootstrap (its default)
    max_gen_toks: int = 256  # generate_until's default when a task sets none (lm-eval's)

    def __post_init__(self) -> None:
        check(
            isinstance(self.tasks, list)
            and self.tasks != []
            and all(isinstance(t, str) and t for t in self.tasks),
            f"eval.tasks must be a non-empty list of task names, got {self.tasks!r}",
        )
        check(
            self.include_path is None or (isinstance(self.include_path, str) and self.include_path),
            f"eval.include_path must be a directory path, got {self.include_path!r}",
        )
        for name in ("num_fewshot", "bootstrap_iters", "max_gen_toks"):
            value = getattr(self, name)
            check(
                value is None
                if name == "num_fewshot" and value is None
                else isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"eval.{name} must be an integer >= 0, got {value!r}",
            )
        check(
            self.limit is None
            or (
                isinstance(self.limit, int | float)
                and not isinstance(self.limit, bool)
                and self.limit > 0
            ),
            f"eval.limit must be null or a number > 0, got {self.limit!r}",
        )


def eval_job_raw(raw: dict[str, Any], base_dir: Path, where: str) -> dict[str, Any]:
    """A job mapping with ``eval:`` made into an ordinary one: ``eval`` an ``EvalConfig``,
    ``input`` the requests file in the output directory, ``fanout`` "all" unless given."""
    if "input" in raw:
        raise ConfigError(
            f"{where}: give 'eval' or 'input', not both (an eval job's input is lm-eval's requests)"
        )
    if "output" not in raw:
        raise ConfigError(f"{where}: missing required key 'output'")
    section = raw["eval"]
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: eval must be a mapping, got {type(section).__name__}")
    section = dict(section)
    if isinstance(section.get("include_path"), str) and section["include_path"]:
        include = Path(section["include_path"]).expanduser()
        section["include_path"] = str(include if include.is_absolute() else base_dir / include)
    try:
        config = from_dict(EvalConfig, section, f"{where}: eval")
    except ConfigError as exc:
        raise ConfigError(exc.args[0] if str(exc).startswith(where) else f"{where}: {exc}") from exc
    output = Path(str(raw["output"])).expanduser()
    output = output if output.is_absolute() else base_dir / output
    return {
        **raw,
        "eval": config,
        "input": str(output / REQUESTS_FILE),
        "fanout": raw.get("fanout", "all"),
    }
