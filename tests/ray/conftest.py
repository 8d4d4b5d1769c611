"""One local Ray instance for the Ray test modules that run jobs in this process (test_ray_job,
test_ray_structured): a cluster start costs seconds of CPU and a handful of processes, which a
loaded 2-core machine pays dearly, so the modules share it (``pytestmark`` asks for it). The CLI
and killed-driver tests start their own Ray in child processes, as a user's command does."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def local_ray():
    """Its workers at nice 0, as ``slora_batch.ray.job.connect`` starts a local instance (Ray's
    default of 15 starved the actors for minutes beside a busy core and the other xdist
    worker); the killed-driver test's child, which starts its own, inherits the setting."""
    ray = pytest.importorskip("ray")
    from slora_batch.ray.job import WORKER_NICENESS

    os.environ.setdefault(WORKER_NICENESS, "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
