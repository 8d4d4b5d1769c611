"""The job tool on a mixture-of-experts base (a tiny random Qwen3-MoE with a tokenizer): a
one-file job with an adapter on the experts, an attention-only adapter, base rows and an adapter
made for another MoE model. ``validate`` names the broken adapter and its tensor before any work;
``run`` writes its rows as error rows naming it and every other row as the engine generates it
alone."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from factory import make_adapter
from moe_factory import make_expert_adapter, make_moe_model
from structured import save_tokenizer
from typer.testing import CliRunner

from cli import app
from slora_batch import Engine, EngineConfig, Request

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
ENGINE = ["--engine", "device=cpu", "--engine", "dtype=float32", "--engine", "num_pages=6000"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "yes", "no", "maybe"]
ADAPTERS = [None, "experts", "attention", "other-model"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-job")
    model_dir = make_moe_model(root, "qwen3-moe", seed=2)
    save_tokenizer(model_dir)
    mixtral = make_moe_model(root / "mixtral", "mixtral", seed=2)  # 4 experts, not 8
    adapters = {
        "experts": make_expert_adapter(model_dir, root / "experts", 4, 8, seed=3),
        "attention": make_adapter(model_dir, root / "attention", 8, ["q_proj", "o_proj"], 16,
                                  False, seed=4),
        "other-model": make_expert_adapter(mixtral, root / "other-model", 2, 4, seed=5),
    }  # fmt: skip
    rows = [
        {"id": i, "adapter": ADAPTERS[i % 4], "prompt": " ".join(WORDS[i % 7 : i % 7 + 3 + i % 4])}
        for i in range(16)
    ]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, adapters, rows, data


def adapter_flags(adapters: dict) -> list[str]:
    return [flag for name, path in adapters.items() for flag in ("--adapters", f"{name}={path}")]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_validate_names_the_adapter_of_another_model_and_its_tensor(moe, tmp_path):
    model_dir, adapters, _, data = moe
    result = invoke("validate", data, "--model", model_dir, *adapter_flags(adapters), "--output",
                    tmp_path / "out", *ENGINE)  # fmt: skip
    assert result.exit_code == 0, result.output  # most rows can run
    text = " ".join(result.output.split())
    assert "other-model" in text and "experts" in text
    assert "layers.0.mlp.experts." in text and "lora_A" in text  # the tensor that does not fit


def test_run_writes_every_row_and_the_broken_adapters_as_error_rows(moe, tmp_path):
    model_dir, adapters, rows, data = moe
    out = tmp_path / "out"
    result = invoke("run", data, "--model", model_dir, *adapter_flags(adapters), "--output", out,
                    "--max-new-tokens", "6", *ENGINE, "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    written = {row["id"]: row for row in pq.read_table(out).to_pylist()}
    assert sorted(written) == [row["id"] for row in rows]
    good = [row for row in rows if row["adapter"] != "other-model"]
    engine = Engine(
        model_dir,
        adapters={k: v for k, v in adapters.items() if k != "other-model"},
        config=EngineConfig(device="cpu", dtype="float32", num_pages=6000),
    )
    alone = {
        r.id: r
        for r in engine.generate(
            Request(id=row["id"], adapter=row["adapter"], prompt=row["prompt"], max_new_tokens=6)
            for row in good
        )
    }
    for row in rows:
        got = written[row["id"]]
        assert got["adapter"] == (row["adapter"] or "")
        if row["adapter"] == "other-model":
            assert got["finish_reason"] == "error"
            assert "other-model" in got["error"] and "gate_up_proj" in got["error"]
            continue
        assert got["finish_reason"] != "error", got["error"]
        assert got["token_ids"] == alone[row["id"]].token_ids
