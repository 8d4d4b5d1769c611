"""The ``job`` system of the bench: the real ``slora-batch run`` path on the bench's requests.

Everything a user's job touches is on disk: the model as a Hugging Face directory (config and
safetensors, written from the bench's weights), one PEFT directory per adapter id (hard links to
its rank's files: distinct paths, so the job reads, caches and evicts every id on its own, as
with distinct files, without 1000 copies on disk), and the requests as a Parquet input of
``prompt_token_ids`` rows (the random model has no tokenizer). ``run_job`` runs it in this
process, on the same device as the other systems; the job's stats give its engine time apart
from start-up (model load, CUDA-graph capture) and writing.

Its ``output_tokens_per_s`` is generated tokens over the job's engine time (the figure
``_stats.parquet`` reports); ``end_to_end_tokens_per_s`` is over the job's whole wall time,
start-up included. Compare with ``slora`` at the same adapter count and ``--max-seconds 0``
(both run every request). ``job-par`` is the same job at ``--tensor-parallel`` x
``--data-parallel``: compare it with ``slora-par``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from slora_batch.bench.roofline import Work
from slora_batch.bench.row_fields import figures
from slora_batch.bench.workload import adapter_name, adapter_sources, group_by_adapter
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.run import run_job

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"


def write_model(ctx, root: Path) -> Path:
    """The bench's model as a Hugging Face directory (its config and one safetensors file)."""
    from safetensors.torch import save_file

    model_dir = root / "job-model"
    if (model_dir / MODEL_FILE).exists():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ctx.model.model_dir / "config.json", model_dir / "config.json")
    weights = {name: t.detach().contiguous().cpu() for name, t in ctx.model.weights.items()}
    save_file(weights, str(model_dir / MODEL_FILE))
    return model_dir


def write_adapters(ctx, root: Path, n: int) -> Path:
    """One PEFT directory per adapter id, its files hard links to its rank's (a copy where the
    file system has no hard links)."""
    adapters = root / f"job-adapters-{n}"
    sources = adapter_sources(n, ctx.rank_dirs)
    for i in range(n):
        target = adapters / adapter_name(i)
        if target.exists():
            continue
        target.mkdir(parents=True)
        for source in sources[adapter_name(i)].iterdir():
            try:
                os.link(source, target / source.name)
            except OSError:
                shutil.copy(source, target / source.name)
    return adapters


def write_input(requests, path: Path) -> Path:
    table = pa.Table.from_pylist(
        [
            {
                "id": r.id,
                "adapter": r.adapter,
                "prompt_token_ids": list(r.prompt_token_ids),
                "max_new_tokens": r.max_new_tokens,
            }
            for r in requests
        ]
    )
    pq.write_table(table, path)
    return path


def run_job_system(ctx, n: int, system: str = "job") -> dict:
    """The workload's requests at ``n`` adapters through a job run; one row of the bench.
    ``job-par`` runs the job at the bench's tensor- and data-parallel layout."""
    cfg, model = ctx.config, ctx.model
    cuda, parallel = model.device.type == "cuda", system == "job-par"
    layout = (cfg.tensor_parallel, cfg.data_parallel) if parallel else (1, 1)
    root = Path(ctx.model.model_dir).parent
    started = time.perf_counter()
    model_dir = write_model(ctx, root)
    adapters = write_adapters(ctx, root, n) if n else None
    requests = group_by_adapter(ctx.workload.requests(n))
    job_dir = root / f"job-{n}"
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir()
    write_input(requests, job_dir / "rows.parquet")
    files_s = time.perf_counter() - started
    log.info("job@%d: model, %d adapter directories and the input written in %.1f s", n, n, files_s)
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    job = JobConfig(
        name=f"bench-job-{n}",
        model=str(model_dir),
        adapters=str(adapters) if adapters else None,
        input=str(job_dir / "rows.parquet"),
        output=str(job_dir / "out"),
        sampling=SamplingConfig(ignore_eos=True, max_new_tokens=max(cfg.max_output, 1)),
        engine=EngineConfig(
            device=("cuda" if cuda else "cpu") if parallel else str(model.device),
            dtype=str(model.dtype).removeprefix("torch."),
            backend=cfg.backend,
            tensor_parallel=layout[0],
            data_parallel=layout[1],
            max_num_seqs=cfg.max_num_seqs,
        ),
    )
    summary = run_job(job)
    stats = summary.stats
    rows = pq.read_table(sorted((job_dir / "out").glob("part-*.parquet"))).to_pylist()
    asked = {r.id: r.max_new_tokens for r in requests}
    work, finished, errors, mismatches = Work(), 0, 0, 0
    for row in rows:
        if row["finish_reason"] == "error":
            errors += 1
            continue
        finished += 1
        mismatches += row["completion_tokens"] != asked[row["id"]]
        work.add(row["prompt_tokens"], row["completion_tokens"])
    engine_s = stats["engine_s"]
    result = dict(
        system=system,
        adapters=n,
        requests=len(requests),
        fed=len(requests),
        finished=finished,
        error_rows=errors,
        length_mismatches=mismatches,
        truncated=False,
        setup_s=(stats["load_s"] or 0.0) + (stats["warmup_s"] or 0.0),
        peak_mem_gib=(  # a parallel job's engines are other processes
            torch.cuda.max_memory_allocated(model.device) / 2**30
            if cuda and not parallel
            else math.nan
        ),
        tensor_parallel=layout[0],
        data_parallel=layout[1],
        host_share=math.nan,
        decode_host_share=math.nan,
        decode_batch=math.nan,
        job_wall_s=stats["wall_s"],
        job_load_s=stats["load_s"],
        job_warmup_s=stats["warmup_s"],
        job_write_s=stats["write_s"],
        job_read_s=stats["read_s"],
        job_files_s=files_s,
        end_to_end_tokens_per_s=work.output_tokens / stats["wall_s"],
        adapter_loads=stats["adapter_loads"],
        adapter_disk_loads=stats["adapter_disk_loads"],
    )
    result.update(figures(ctx, work, finished, engine_s, layout[0] * layout[1] if cuda else 1))
    log.info(
        "%s@%d: %d rows, engine %.1f s (%.0f tok/s), wall %.1f s (%.0f tok/s end to end): "
        "load %.1f s, warmup %.1f s, read %.1f s, write %.1f s; %d adapter disk loads",
        system,
        n,
        finished,
        engine_s,
        result["output_tokens_per_s"],
        stats["wall_s"],
        result["end_to_end_tokens_per_s"],
        stats["load_s"] or 0.0,
        stats["warmup_s"] or 0.0,
        stats["read_s"],
        stats["write_s"],
        stats["adapter_disk_loads"] or 0,
    )
    shutil.rmtree(job_dir / "out", ignore_errors=True)
    return result
