"""An eval job's engine built while lm-eval prepares the job's input: the engine's start-up
(weights, kernels, CUDA graphs: seconds) and lm-eval's task loading and request building (about
a second) overlap instead of adding up.

The engine is built on the calling thread, as the job would build it (``jobs.run._build_engine``
of the checked plan: the same model directory and adapter sources, resolved the same way), and
lm-eval prepares on a helper thread, touching no CUDA state (``tasks.reseed(cuda=False)``). Only
a job that will run gets one: not one complete already, not one whose output directory another
run holds. The run takes it (``run_plan(build_engine=...)``) and closes it; one it never takes
(no row was left) is closed by ``close``. Should the early build fail, the job builds its engine
itself, and says why it cannot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slora_batch.jobs.check import JobPlan
    from slora_batch.jobs.config import JobConfig

logger = logging.getLogger(__name__)


class EarlyEngine:
    """One job's engine, built now; ``take`` hands it to the run, ``close`` frees it untaken."""

    def __init__(self, job: JobConfig) -> None:
        from slora_batch.engine.hub import locate
        from slora_batch.engine.models.sample_model import resolve_model
        from slora_batch.engine.parallel.data_parallel import open_engine

        located = locate(job.model, job.adapters)  # as check_job resolves them
        self.engine = open_engine(
            resolve_model(located.model), located.adapters, job.engine, job.sampling
        )
        self.taken = False

    def take(self, plan: JobPlan) -> Any:
        self.taken = True
        return self.engine

    def close(self) -> None:
        if not self.taken:
            self.taken = True
            self.engine.close()


def prepare_beside_engine(
    job: JobConfig, prepare: Callable[[], Any]
) -> tuple[Any, EarlyEngine | None]:
    """(``prepare()``'s value, the job's engine or None): the engine built on this thread
    while ``prepare`` runs on another."""
    with ThreadPoolExecutor(1, thread_name_prefix="lm-eval-prepare") as pool:
        preparing = pool.submit(prepare)
        early = None
        if output_free(Path(job.output)):
            try:
                early = EarlyEngine(job)
            except Exception as exc:  # noqa: BLE001 - the job's own build says why
                logger.debug("job %s: no engine before the run: %s", job.name, exc)
        try:
            return preparing.result(), early
        except BaseException:
            if early is not None:
                early.close()
            raise


def output_free(out: Path) -> bool:
    """Whether no other run holds ``out`` now (its lock taken and given back at once)."""
    from slora_batch.jobs.lock import OutputLock
    from slora_batch.jobs.outdir import OutputError

    try:
        OutputLock(out).release()
    except (OutputError, OSError):
        return False
    return True
