"""One local Ray instance for the Ray test modules that run jobs in this process (test_ray_job,
test_ray_structured): a cluster start costs seconds of CPU and a handful of processes, which a
loaded 2-core machine pays dearly, so the modules share it (``pytestmark`` asks for it). The CLI
and killed-driver tests start their own Ray in child processes, as a user's command does."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
