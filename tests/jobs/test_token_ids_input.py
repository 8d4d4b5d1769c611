"""Rows that bring their prompt as token ids (``prompt_token_ids``): a model directory without a
tokenizer (the bench's random models) runs through the job tool, and bad id lists are error rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from factory import make_adapter, make_model

from slora_batch import Engine, EngineConfig, Request
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.run import run_job


def test_prompt_token_ids_rows_match_the_engine(tmp_path):
    model = make_model(tmp_path, "gqa")  # config and weights, no tokenizer
    adapter = make_adapter(model, tmp_path / "adapters" / "a", 4, ["q_proj", "v_proj"], 8, False, 1)
    rows = [
        {"id": 1, "adapter": "a", "prompt_token_ids": [5, 6, 7, 8]},
        {"id": 2, "adapter": None, "prompt_token_ids": [9, 10]},
        {"id": 3, "adapter": "a", "prompt_token_ids": [5, -1]},
        {"id": 4, "adapter": "a", "prompt_token_ids": []},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    (tmp_path / "jobs.yaml").write_text(
        f"jobs:\n  - name: ids\n    model: {model}\n    adapters: {adapter.parent}\n"
        "    input: rows.parquet\n    output: out\n"
        "    sampling: {max_new_tokens: 4, ignore_eos: true}\n"
        "    engine: {device: cpu, dtype: float32, num_pages: 2000}\n"
    )
    (job,) = load_jobs(tmp_path / "jobs.yaml")
    run_job(job)
    got = {r["id"]: r for r in pq.read_table(sorted((tmp_path / "out").glob("part-*"))).to_pylist()}
    engine = Engine(
        model, adapters=adapter.parent, config=EngineConfig(device="cpu", num_pages=2000)
    )
    want = {
        r.id: r.token_ids
        for r in engine.generate(
            Request(id=row["id"], adapter=row["adapter"], prompt_token_ids=row["prompt_token_ids"],
                    max_new_tokens=4, ignore_eos=True)
            for row in rows[:2]
        )
    }  # fmt: skip
    assert {i: got[i]["token_ids"] for i in (1, 2)} == want
    assert got[1]["text"] == "" and got[1]["finish_reason"] == "length"  # no tokenizer: no text
    for bad in (3, 4):
        assert got[bad]["finish_reason"] == "error"
        assert "prompt_token_ids" in got[bad]["error"] and "rows.parquet row" in got[bad]["error"]
