"""The ``eval:`` section's keys under the eval package's name: they are a part of the job file
and are defined with it (``jobs/eval_keys.py``)."""

from slora_batch.jobs.eval_keys import REQUESTS_FILE, EvalConfig, eval_job_raw

__all__ = ["REQUESTS_FILE", "EvalConfig", "eval_job_raw"]
