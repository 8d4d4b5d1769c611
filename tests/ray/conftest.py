"""One local Ray instance for every Ray test of the session: a cluster start costs seconds of CPU
and a handful of processes, which a loaded 2-core machine pays dearly, so the modules share it
(``pytestmark`` asks for it). The killed-driver test's child joins it as a driver of its own; the
CLI test starts its own Ray in a child process only where the README's ``--ray local`` start is
what it checks."""

from __future__ import annotations

import os

import pytest

# Ray's raylet kills an idle worker process once it has more workers than CPUs: each run's two
# engine actors and Ray Data's three service actors then cost the pipeline's read and shuffle
# workers, and the next run started them again (a process and Ray Data's imports each, seconds
# of CPU). Workers kept while the session holds fewer than this many processes are reused.
KEEP_IDLE_WORKERS = {"num_workers_soft_limit": 32}


@pytest.fixture(scope="session")
def local_ray() -> str:
    """The shared instance's GCS address (for a driver in a child process to join). Its workers
    at nice 0, as ``slora_batch.ray.job.connect`` starts a local instance (Ray's default of 15
    starved the actors for minutes beside a busy core and the other xdist worker)."""
    ray = pytest.importorskip("ray")
    from slora_batch.ray.job import WORKER_NICENESS

    os.environ.setdefault(WORKER_NICENESS, "0")
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, _system_config=KEEP_IDLE_WORKERS
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
