"""The single-machine tool never imports Ray nor lm-eval (optional extras): not ``import cli``,
not a run."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_jobrun import build_tiny, make_rows, write_job, write_jsonl

CHECK = """
import sys
import cli
assert not {"ray", "torch", "lm_eval"} & set(sys.modules), "import cli loaded ray, torch or lm_eval"
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.run import run_job
(job,) = load_jobs(sys.argv[1])
assert run_job(job).stats["rows"] == 6
assert "ray" not in sys.modules, "a plain run imported ray"
assert "lm_eval" not in sys.modules, "a plain run imported lm_eval (the eval extra)"
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def test_cli_and_a_plain_run_do_not_import_ray(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    job_file = write_job(tmp_path, tiny)
    subprocess.run([sys.executable, "-c", CHECK, str(job_file)], check=True, timeout=300)
