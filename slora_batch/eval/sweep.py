"""An eval job: every lm-eval task for the base model and every adapter in one engine pass.

1. lm-eval builds the tasks' requests once (``TaskManager``, ``build_all_requests``, with
   ``simple_evaluate``'s num_fewshot rule and seeds); each becomes engine rows (``rows.py``),
   written as the job's input file (``_eval_requests.jsonl`` in the output directory; rewritten
   only when its contents change, so a re-run resumes);
2. the ordinary job machinery runs that file fanned out over the adapters (``fanout: all``):
   one engine, one pass, parts with exactly-once resume; shared contexts meet in the prefix
   cache;
3. per adapter, lm-eval's own ``evaluate`` runs with a model that replays that adapter's rows,
   so every metric, filter and aggregation is lm-eval's code: as soon as the adapter's rows are
   all in, while the engine runs the later adapters' (``scoring``; the rows come adapter by
   adapter), else at the end from the parts.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from slora_batch.eval.early import prepare_beside_engine
from slora_batch.eval.encoding import Encoder
from slora_batch.eval.report import write_results
from slora_batch.eval.rows import request_rows
from slora_batch.eval.scoring import AdapterScoring, read_parts
from slora_batch.eval.tasks import adapter_scorer, build_requests, load_tasks
from slora_batch.eval.worker import ScoringProcess
from slora_batch.jobs.check import JobPlan, check_job
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.eval_keys import REQUESTS_FILE
from slora_batch.jobs.manifest import fingerprint
from slora_batch.jobs.outdir import SUCCESS_FILE, commit_file
from slora_batch.jobs.progress import ProgressCallback
from slora_batch.jobs.run import run_plan
from slora_batch.jobs.summary import JobSummary
from slora_batch.jobs.validate import ValidationReport, validate_job

logger = logging.getLogger(__name__)


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


def model_context(job: JobConfig) -> tuple[Path, int]:
    """(the model's directory, the context its requests are cut to: HFLM's rule, the model's
    context or the engine's ``max_model_len`` when smaller)."""
    from slora_batch.engine.hub import locate
    from slora_batch.engine.models.sample_model import resolve_model
    from slora_batch.engine.models.spec import read_spec

    model_path = resolve_model(locate(job.model, None).model)
    spec = read_spec(model_path)
    return model_path, min(job.engine.max_model_len or spec.max_context, spec.max_context)


def prepare(job: JobConfig, out: Path, cuda: bool = True) -> tuple[Encoder, dict[str, Any], int]:
    """The tasks' requests, built once and written to ``out``'s requests file: (the encoder,
    the loaded tasks, the engine rows per adapter). ``cuda``: ``tasks.reseed``'s."""
    from slora_batch.engine.requests.tokens import load_tokenizer

    config = job.eval
    model_path, max_length = model_context(job)
    encoder = Encoder(load_tokenizer(model_path), max_length, config.max_gen_toks)
    loaded = load_tasks(config)
    requests = build_requests(loaded, config.limit, cuda)
    rows = write_requests(out, encoder, requests)
    logger.info(
        "job %s: %d lm-eval requests of %d tasks, %d engine rows per adapter",
        job.name,
        len(requests),
        len(loaded["tasks"]),
        rows,
    )
    return encoder, loaded, rows


def validate_with_requests(job: JobConfig, limit: int | None) -> ValidationReport:
    """``jobs.validate.validate_job`` of an eval job that has not run yet: its requests built
    into a temporary directory, the output directory untouched."""
    with tempfile.TemporaryDirectory() as tmp:
        prepare(job, Path(tmp))
        return validate_job(dataclasses.replace(job, input=str(Path(tmp) / REQUESTS_FILE)), limit)


def checked(job: JobConfig, out: Path) -> tuple[Encoder, dict[str, Any], int, JobPlan]:
    """``prepare`` (CPU seeds only: beside the engine's start-up), then the job checked and its
    fingerprint taken (``JobPlan.taken``), as the run would take it."""
    prepared = prepare(job, out, cuda=False)
    plan = check_job(job)
    plan.taken = fingerprint(plan)
    return (*prepared, plan)


def run_eval(
    job: JobConfig, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    """Run an eval job: its input (lm-eval's requests) built, then the job's run
    (``jobs.run.run_plan``) with the sweep's hooks. A job that will run builds its engine while
    lm-eval prepares (``early``), and scores each adapter as soon as its rows are in, in a
    process of its own (``scoring``, ``worker``)."""
    config, out = job.eval, Path(job.output)
    fresh = overwrite or not (out / SUCCESS_FILE).exists()  # else complete: scored from parts
    worker = early = None
    if fresh:
        model_path, max_length = model_context(job)
        try:
            worker = ScoringProcess(config, str(model_path), max_length, out)
        except OSError as exc:  # no second interpreter: every adapter is scored here
            logger.info("job %s: no lm-eval scoring process (%s)", job.name, exc)
    # the collector's full passes then skip what is here before the engine (lm-eval's tasks,
    # the imports): 0.3-0.6 s each on the CPU, a few per run, and the engine's close
    freeze = gc.get_freeze_count() == 0  # unless the caller froze its own
    try:
        if fresh:  # the job's own checks beside the engine's start-up too (they read files)
            prepared, early = prepare_beside_engine(job, lambda: checked(job, out))
            encoder, loaded, rows, plan = prepared
        else:
            encoder, loaded, rows = prepare(job, out)
            plan = check_job(job)
        scoring = AdapterScoring(rows, adapter_scorer(config, encoder, loaded), worker)
        if freeze:
            gc.freeze()
        summary = run_plan(
            plan,
            overwrite=overwrite,
            progress=progress,
            on_result=scoring.add,
            build_engine=early.take if early is not None else None,
        )
        per_adapter = scoring.finish(plan.sweep or [None], lambda: read_parts(out))
    finally:
        if freeze:
            gc.unfreeze()
        if early is not None:
            early.close()
        if worker is not None:
            worker.close()
    summary.eval_results = write_results(out, per_adapter)
    return summary
