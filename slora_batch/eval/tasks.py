"""lm-eval's side of an eval job: the tasks loaded and their requests built as
``simple_evaluate`` does (its num_fewshot rule and seeds), and each adapter scored by lm-eval's
own ``evaluate`` with a ``Replay`` of that adapter's rows, so every metric, filter and
aggregation is lm-eval's code. The job's process (``sweep``) and the scoring process
(``worker``) both build the tasks here: the same seeded build, the same requests.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

from lm_eval.api.model import LM

from slora_batch.eval.encoding import Encoder
from slora_batch.eval.report import Scored, scored
from slora_batch.eval.rows import answer
from slora_batch.jobs.eval_keys import EvalConfig

logger = logging.getLogger(__name__)
SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}  # simple_evaluate's


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


def reseed(loaded: dict[str, Any], cuda: bool = True) -> None:
    """simple_evaluate's seeds, again before every build of the requests: the few-shot sampler
    draws the same examples each time. ``cuda`` False seeds torch's CPU generator alone (a
    build beside the engine's start-up, which may be capturing CUDA graphs on its thread;
    building requests draws nothing from torch)."""
    import numpy as np
    import torch

    random.seed(SEEDS["random"])
    np.random.seed(SEEDS["numpy"])
    if cuda:
        torch.manual_seed(SEEDS["torch"])
    else:
        torch.random.default_generator.manual_seed(SEEDS["torch"])
    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=SEEDS["fewshot"])


def build_requests(
    loaded: dict[str, Any], limit: int | float | None, cuda: bool = True
) -> list[tuple[str, tuple]]:
    """Every task's (request type, arguments), as ``evaluate`` builds them (``cuda``:
    ``reseed``'s)."""
    from lm_eval.evaluator_utils import get_sample_size

    reseed(loaded, cuda)
    found = []
    for task in loaded["tasks"].values():
        task.build_all_requests(limit=get_sample_size(task, limit), rank=0, world_size=1)
        found += [(instance.request_type, instance.args) for instance in task.instances]
    return found


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
        return [
            answer(self.encoder, request_type, r.args, self.results, self.adapter) for r in requests
        ]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._answers("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._answers("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._answers("generate_until", requests)


def adapter_scorer(config: EvalConfig, encoder: Encoder, loaded: dict[str, Any]):
    """``score(adapter, rows)`` -> ``report.Scored``: lm-eval's ``evaluate`` of the built tasks
    (``build_requests`` ran) with a ``Replay`` of the adapter's rows, reseeded each time, the
    instances and the documents' templates shared by every adapter."""
    from lm_eval.evaluator import evaluate

    reuse_instances(loaded)
    reuse_doc_templates(loaded)

    def score(adapter: str | None, rows: dict[str, dict[str, Any]]) -> Scored:
        reseed(loaded)
        output = evaluate(
            lm=Replay(encoder, rows, adapter),
            task_dict=loaded,
            limit=config.limit,
            bootstrap_iters=config.bootstrap_iters,
            fewshot_as_multiturn=True,
            log_samples=False,
        )
        return scored(adapter, output)

    return score
