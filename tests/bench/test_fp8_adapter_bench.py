"""The bench's fp8-adapter system on the CPU: ``slora-fp8a`` runs slora's requests and adapters
with their A and B rows stored in e4m3 (``adapter_dtype: fp8``)."""

from __future__ import annotations

import pyarrow.parquet as pq
import typer
from typer.testing import CliRunner

import slora_batch.bench.engine_run as engine_run
from slora_batch.bench.cli import bench


def test_cli_runs_slora_and_slora_fp8a_on_the_same_requests(tmp_path, monkeypatch):
    stored = {}
    assemble = engine_run.assemble

    def recording(model_dir, sources, config, *args):
        engine = assemble(model_dir, sources, config, *args)
        stored[config.adapter_dtype] = engine.store.fp8
        return engine

    monkeypatch.setattr(engine_run, "assemble", recording)
    app = typer.Typer()
    app.command()(bench)
    out = tmp_path / "out"
    args = [
        "--model-preset",
        "tiny",
        "--device",
        "cpu",
        "--systems",
        "slora,slora-fp8a",
        "--adapters",
        "8",
        "--requests",
        "8",
        "--min-input",
        "8",
        "--max-input",
        "16",
        "--min-output",
        "4",
        "--max-output",
        "6",
        "--warmup-requests",
        "0",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [(r["system"], r["adapters"]) for r in rows] == [("slora", 8), ("slora-fp8a", 8)]
    for row in rows:
        assert row["error"] is None and row["finished"] == 8 and row["error_rows"] == 0
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"]
    assert stored == {"auto": False, "fp8": True}
