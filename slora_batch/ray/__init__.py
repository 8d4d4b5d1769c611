"""The same jobs past one machine, on a Ray cluster (optional extra: ``pip install -e ".[ray]"``).

stage.py    generate(ds, ...): a Ray Data stage of engine actors; EngineActor
job.py      run_ray_jobs: a job file on Ray into the job tool's output directory, exactly once;
            RayRows, the job lifecycle's executor on Ray (``jobs/lifecycle.py``)
execute.py  the job's Ray Data pipeline: actors sized to the cluster, units, the stall watch
fence.py    part names (run and unit) and the fence against an earlier run's late parts
fs.py       input and output through pyarrow.fs (s3://, gs://, ...); a part committed

Nothing here is imported by the single-machine tool (this package imports ``jobs/``, never the
reverse); ``ray`` is imported on first use.
"""


def __getattr__(name: str):
    if name == "generate":
        from slora_batch.ray.stage import generate

        return generate
    if name in ("run_ray_jobs", "run_ray_job", "RaySettings"):
        from slora_batch.ray import job

        return getattr(job, name)
    raise AttributeError(f"module 'slora_batch.ray' has no attribute {name!r}")
