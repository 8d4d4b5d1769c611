"""An eval job: every lm-eval task for the base model and every adapter in one engine pass.

1. lm-eval builds the tasks' requests once (``TaskManager``, ``build_all_requests``, with
   ``simple_evaluate``'s num_fewshot rule and seeds); each becomes engine rows (``rows.py``),
   written as the job's input file (``_eval_requests.jsonl`` in the output directory; rewritten
   only when its contents change, so a re-run resumes);
2. the ordinary job machinery runs that file fanned out over the adapters (``fanout: all``):
   one engine, one pass, parts with exactly-once resume; shared contexts meet in the prefix
   cache;
3. per adapter, lm-eval's own ``evaluate`` runs with a model that replays that adapter's rows
   from the parts, so every metric, filter and aggregation is lm-eval's code.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
from lm_eval.api.model import LM

from slora_batch.eval.config import REQUESTS_FILE, EvalConfig
from slora_batch.eval.encoding import Encoder
from slora_batch.eval.report import results_rows, write_results
from slora_batch.eval.rows import answer, request_rows
from slora_batch.jobs.outdir import commit_file, part_files

if TYPE_CHECKING:
    from slora_batch.jobs.config import JobConfig
    from slora_batch.jobs.summary import JobSummary

logger = logging.getLogger(__name__)
SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}  # simple_evaluate's
PART_COLUMNS = ["id", "adapter", "logprob", "is_greedy", "token_ids", "error"]


def load_tasks(config: EvalConfig) -> dict[str, Any]:
    """lm-eval's loaded tasks ({"tasks", "groups", ...}), configured as simple_evaluate does.

    lm-eval indexes its ~14,000 built-in task files first (4-5 s on a fast core, 10 s here);
    when ``include_path`` holds every task asked for, its index alone loads them, the same
    tasks (``include_path`` takes precedence over the built-ins anyway). A task it lacks, or
    a local group naming a built-in task, falls back to the whole index."""
    from lm_eval.tasks import TaskManager

    loaded = None
    if config.include_path:
        local = TaskManager(include_path=config.include_path, include_defaults=False)
        if set(config.tasks) <= set(local.all_tasks):
            try:
                loaded = local.load(list(config.tasks))
            except Exception:  # noqa: BLE001 - a group over built-in tasks: the whole index
                logger.debug("tasks %s need lm-eval's built-in index", config.tasks)
    if loaded is None:
        loaded = TaskManager(include_path=config.include_path).load(list(config.tasks))
    for task in loaded["tasks"].values():
        if config.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=config.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
    return loaded


def reseed(loaded: dict[str, Any]) -> None:
    """simple_evaluate's seeds, again before every build of the requests: the few-shot sampler
    draws the same examples each time."""
    import numpy as np
    import torch

    random.seed(SEEDS["random"])
    np.random.seed(SEEDS["numpy"])
    torch.manual_seed(SEEDS["torch"])
    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=SEEDS["fewshot"])


def build_requests(loaded: dict[str, Any], limit: int | float | None) -> list[tuple[str, tuple]]:
    """Every task's (request type, arguments), as ``evaluate`` builds them."""
    from lm_eval.evaluator_utils import get_sample_size

    reseed(loaded)
    found = []
    for task in loaded["tasks"].values():
        task.build_all_requests(limit=get_sample_size(task, limit), rank=0, world_size=1)
        found += [(instance.request_type, instance.args) for instance in task.instances]
    return found


def write_requests(out: Path, encoder: Encoder, requests: list[tuple[str, tuple]]) -> int:
    """Write the requests file (only when its contents change); the number of rows."""
    rows: dict[str, dict[str, Any]] = {}
    for request_type, args in requests:
        for row in request_rows(encoder, request_type, args):
            rows.setdefault(row["id"], row)
    text = "".join(json.dumps(row) + "\n" for row in rows.values()).encode()
    path = out / REQUESTS_FILE
    if not path.is_file() or path.read_bytes() != text:
        out.mkdir(parents=True, exist_ok=True)
        commit_file(path, lambda handle: handle.write(text))
    return len(rows)


def reuse_instances(loaded: dict[str, Any]) -> None:
    """Hand every adapter's ``evaluate`` the instances ``build_requests`` made, emptied of the
    last adapter's answers, instead of building them again: the same requests (the build is
    seeded), and building was half of each adapter's evaluate (the prompts' templates)."""

    for task in loaded["tasks"].values():
        built = list(task.instances)

        def rebuild(*_, task=task, built=built, **__) -> None:
            for instance in built:
                instance.resps, instance.filtered_resps = [], {}
            task._instances = built

        task.build_all_requests = rebuild


DOC_TEMPLATES = ("doc_to_text", "doc_to_target", "doc_to_choice")


def reuse_doc_templates(loaded: dict[str, Any]) -> None:
    """Render each document's text, target and choices once for all adapters: ``evaluate``
    renders them again for every document of every adapter (``process_results``), and the
    templates were most of what an adapter's ``evaluate`` cost after ``reuse_instances``. Keyed
    by the document's JSON; a call with arguments besides the document is not cached."""

    for task in loaded["tasks"].values():
        for name in DOC_TEMPLATES:
            method = getattr(task, name, None)
            if method is None:
                continue
            cache: dict[str, Any] = {}

            def cached(doc, *args, method=method, cache=cache, **kwargs):
                if args or kwargs:
                    return method(doc, *args, **kwargs)
                key = json.dumps(doc, sort_keys=True, default=repr)
                if key not in cache:
                    cache[key] = method(doc)
                found = cache[key]
                return list(found) if isinstance(found, list) else found

            setattr(task, name, cached)


class Replay(LM):
    """An lm-eval model answering from one adapter's finished rows."""

    def __init__(self, encoder: Encoder, results: dict[str, dict[str, Any]], adapter: str | None):
        super().__init__()
        self.encoder, self.results, self.adapter = encoder, results, adapter

    def _answers(self, request_type: str, requests) -> list[Any]:
        return [answer(self.encoder, request_type, r.args, self.results, self.adapter)
                for r in requests]  # fmt: skip

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._answers("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._answers("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._answers("generate_until", requests)


def read_results(out: Path) -> dict[str | None, dict[str, dict[str, Any]]]:
    """{adapter: {row id: the row's fields}} from the committed parts."""
    found: dict[str | None, dict[str, dict[str, Any]]] = {}
    for _, path in part_files(out):
        for row in pq.read_table(path, columns=PART_COLUMNS).to_pylist():
            found.setdefault(row["adapter"], {})[str(row["id"])] = row
    return found


def prepare(job: JobConfig, out: Path) -> tuple[Encoder, dict[str, Any], list]:
    """The tasks' requests, built once and written to ``out``'s requests file: (the encoder,
    the loaded tasks, the requests)."""
    from slora_batch.engine.hub import locate
    from slora_batch.engine.models.sample_model import resolve_model
    from slora_batch.engine.models.spec import read_spec
    from slora_batch.engine.requests.tokens import load_tokenizer

    config = job.eval
    model_path = resolve_model(locate(job.model, None).model)
    spec = read_spec(model_path)
    max_length = min(job.engine.max_model_len or spec.max_context, spec.max_context)
    encoder = Encoder(load_tokenizer(model_path), max_length, config.max_gen_toks)
    loaded = load_tasks(config)
    requests = build_requests(loaded, config.limit)
    rows = write_requests(out, encoder, requests)
    logger.info("job %s: %d lm-eval requests of %d tasks, %d engine rows per adapter", job.name,
                len(requests), len(loaded["tasks"]), rows)  # fmt: skip
    return encoder, loaded, requests


def validate_with_requests(job: JobConfig, validate: Callable, limit: int | None):
    """``validate`` (``jobs.validate.validate_job``) of an eval job that has not run yet: its
    requests built into a temporary directory, the output directory untouched."""
    import dataclasses
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        prepare(job, Path(tmp))
        return validate(dataclasses.replace(job, input=str(Path(tmp) / REQUESTS_FILE)), limit)


def run_eval(
    job: JobConfig,
    run_plan: Callable[..., JobSummary],
    overwrite: bool = False,
    progress: Callable | None = None,
) -> JobSummary:
    """Run an eval job (``run_plan`` is ``jobs.run.run_plan``, handed in: no import circle)."""
    from lm_eval.evaluator import evaluate

    from slora_batch.jobs.check import check_job

    config, out = job.eval, Path(job.output)
    encoder, loaded, _ = prepare(job, out)
    plan = check_job(job)
    summary = run_plan(plan, overwrite=overwrite, progress=progress)
    results = read_results(out)
    reuse_instances(loaded)
    reuse_doc_templates(loaded)
    per_adapter = {}
    for adapter in plan.sweep or [None]:
        reseed(loaded)
        lm = Replay(encoder, results.get(adapter, {}), adapter)
        per_adapter[adapter] = evaluate(lm=lm, task_dict=loaded, limit=config.limit,
                                        bootstrap_iters=config.bootstrap_iters,
                                        fewshot_as_multiturn=True,
                                        log_samples=False)  # fmt: skip
    write_results(out, per_adapter)
    summary.eval_results = results_rows(per_adapter)
    return summary
