"""``validate`` says what each adapter changes in the model (which modules, on which layers, with
LoRA, DoRA, lora_bias, on the experts, on the heads, trained copies), notes the target_modules
entries that match no module, and refuses an adapter that changes nothing the model has or
whose shapes do not fit: named with its tensor and the reason, by ``validate`` and by ``run``,
whose rows for it are error rows while the other adapters' rows run. On the tiny model of
``test_jobrun`` (2 layers, tied embeddings, the sample model's tokenizer)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from factory import make_adapter, rewrite_adapter, tiny_spec
from test_jobrun import (
    PAGES,
    build_tiny,
    forbid_weights,
    load_job,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    outputs,
    write_job,
    write_jsonl,
)
from typer.testing import CliRunner

from cli import app
from slora_batch.engine.adapters.changes import (
    adapter_changes,
    change_refusal,
    layer_span,
    unmatched_targets,
)
from slora_batch.engine.adapters.store import parse_adapter
from slora_batch.engine.models.spec import read_spec
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

ENV = {"COLUMNS": "400", "NO_COLOR": "1"}
LLAMA = "LlamaForCausalLM"
# adapter -> what validate says it changes (the tiny model has layers 0 and 1)
SUMMARIES = {
    "lora": "LoRA: q_proj, v_proj on layers 0-1",
    "dora": "DoRA: q_proj, o_proj on layer 1",
    "bias": "LoRA + bias: k_proj, down_proj on layers 0-1",
    "head": "LoRA: q_proj on layers 0-1 | head LoRA: lm_head",
    "typo": "LoRA: q_proj, v_proj on layers 0-1",
}
QV = "base_model.model.model.layers.0.self_attn"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


@pytest.fixture(scope="module")
def zoo(tiny, tmp_path_factory) -> dict:
    """Adapters of the tiny model, one per kind, and ones that cannot run (name -> path)."""
    root = tmp_path_factory.mktemp("zoo")
    model, plain = tiny.model, tiny.adapters / "a"  # r 4 on q_proj and v_proj
    zoo = {"lora": shutil.copytree(plain, root / "lora")}
    zoo["dora"] = make_adapter(model, root / "dora", 4, ["q_proj", "o_proj"], 8, False, seed=3,
                               use_dora=True, layers_to_transform=[1], layers_pattern="layers")  # fmt: skip
    zoo["bias"] = make_adapter(
        model, root / "bias", 2, ["k_proj", "down_proj"], 4, False, seed=4, lora_bias=True
    )
    zoo["head"] = make_adapter(model, root / "head", 2, ["q_proj", "lm_head"], 4, False, seed=5)
    typo = {"target_modules": ["q_proj", "v_proj", "q_prj"]}
    zoo["typo"] = rewrite_adapter(plain, root / "typo", typo)
    # Phi-3's fused projection: no module of a Llama, though the tensors are on q and v
    zoo["elsewhere"] = rewrite_adapter(plain, root / "elsewhere", {"target_modules": ["qkv_proj"]})
    embedding = "base_model.model.model.embed_tokens.weight"
    zoo["copies-only"] = rewrite_adapter(
        plain,
        root / "copies-only",
        {"target_modules": ["embed_tokens"]},
        lambda _: {embedding: torch.zeros(49152, 64, dtype=torch.float16)},  # the model's shape
    )
    zoo["no-tensors"] = rewrite_adapter(plain, root / "no-tensors", tensors=lambda _: {})
    zoo["other-module"] = rewrite_adapter(
        plain,
        root / "other-module",
        {"target_modules": ["qkv_proj", "v_proj"]},
        lambda tensors: {k.replace("q_proj", "qkv_proj"): v for k, v in tensors.items()},
    )
    zoo["wide"] = tiny.bad["rank-mismatch"]  # r 8 in the config, rank-4 tensors
    return zoo


def rows_of(names: list[str], per_adapter: int = 2) -> list[dict]:
    return [
        {"id": f"{name}-{i}", "adapter": name, "prompt": "the quick brown fox jumps"}
        for name in names
        for i in range(per_adapter)
    ] + [{"id": "base-0", "adapter": None, "prompt": "over the lazy dog"}]


def job_of(tmp_path, tiny, zoo, names: list[str], **keys):
    write_jsonl(tmp_path / "rows.jsonl", rows_of(names))
    return load_job(tmp_path, tiny, adapters={n: str(zoo[n]) for n in names}, **keys)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_validate_says_what_each_adapter_changes(tmp_path, tiny, zoo, monkeypatch):
    job = job_of(tmp_path, tiny, zoo, list(SUMMARIES))
    with monkeypatch.context() as patch:
        forbid_weights(patch)
        report = validate_job(job)
        grouped = invoke("validate", write_job(tmp_path, tiny, adapters=job.adapters))
        each = invoke("validate", tmp_path / "jobs.yaml", "--per-adapter")
    assert not report.broken and not report.problems
    assert {c.name: c.summary for c in report.changes} == SUMMARIES
    assert {c.name: c.unmatched for c in report.changes if c.unmatched} == {
        "typo": (("target_modules", "q_prj"),)
    }
    assert grouped.exit_code == 0 and each.exit_code == 0, grouped.stdout + each.stdout
    lines = [line.strip() for line in grouped.stdout.splitlines()]
    assert "2 adapters (lora, typo): LoRA: q_proj, v_proj on layers 0-1" in lines
    assert "1 adapter (head): LoRA: q_proj on layers 0-1 | head LoRA: lm_head" in lines
    note = (
        f"note: adapter 'typo': target_modules 'q_prj' matches no module of {LLAMA} (its LoRA "
        "modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); the adapter "
        "runs on the modules that match"
    )
    assert note in lines
    each_lines = [line.strip() for line in each.stdout.splitlines()]
    assert all(f"{name}: {summary}" in each_lines for name, summary in SUMMARIES.items())
    summary = run_job(job)  # the noted adapter runs on its matching modules
    assert summary.stats["error_rows"] == 0 and not summary.broken


def test_expert_lora_and_trained_copies_are_named(tmp_path, tiny):
    """LoRA on the experts (PEFT's target_parameters, and transformers 4's per-expert modules
    under Mixtral's names) with the router; the modules ``modules_to_save`` replaces. None of
    these configs' targets is taken for one the model lacks."""
    from moe_factory import make_expert_adapter, make_moe_model, write_per_expert_adapter

    qwen = make_moe_model(tmp_path, "qwen3-moe")
    fused = make_expert_adapter(qwen, tmp_path / "fused", 3, 6, seed=1, modules=["q_proj"])
    mixtral = make_moe_model(tmp_path, "mixtral")
    per_expert = write_per_expert_adapter(
        mixtral, tmp_path / "w", 2, 4, seed=2, projections=("gate", "up"), router=True
    )
    for model, path, want in (
        (qwen, fused, "LoRA: q_proj on layers 0-1 | "
                      "expert LoRA: experts.gate_up_proj, experts.down_proj on layers 0-1"),
        (mixtral, per_expert, "LoRA: gate (router) on layers 0-1 | "
                              "expert LoRA: experts.gate_up_proj on layers 0-1"),
    ):  # fmt: skip
        spec = read_spec(model)
        info = parse_adapter(path.name, path, spec)
        cfg = json.loads((path / "adapter_config.json").read_text())
        changes = adapter_changes(info, cfg, spec)
        assert (changes.summary, changes.unmatched) == (want, ())
        assert change_refusal(info, cfg, spec) is None
    saved = make_adapter(
        tiny.model, tmp_path / "saved", 2, ["v_proj"], 4, False, seed=6, modules_to_save=["lm_head"]
    )
    spec = read_spec(tiny.model)
    cfg = json.loads((saved / "adapter_config.json").read_text())
    changes = adapter_changes(parse_adapter("saved", saved, spec), cfg, spec)
    assert changes.summary == "LoRA: v_proj on layers 0-1 | trained copy: lm_head"


def test_targets_match_as_peft_matches_them():
    """A list entry is a module's name or its end after a dot; a string is a regular expression
    the whole name must match; "all-linear" always matches; entries of target_parameters too."""
    spec = tiny_spec(num_layers=24)
    cfg = {
        "target_modules": ["q_proj", "self_attn.v_proj", "model.layers.3.mlp.up_proj", "_proj",
                           "layers.24.self_attn.q_proj", "qkv_proj", "embed_tokens", "lm_head"],
        "target_parameters": ["mlp.experts.down_proj"],
    }  # fmt: skip
    assert unmatched_targets(cfg, spec) == (
        ("target_modules", "_proj"),
        ("target_modules", "layers.24.self_attn.q_proj"),
        ("target_modules", "qkv_proj"),
        ("target_parameters", "mlp.experts.down_proj"),
    )
    for pattern, unmatched in ((r".*\.(q|v)_proj", False), (r".*layers\.1\d\.mlp\.down_proj", False),
                               ("all-linear", False), (r"q_proj", True), (r".*\.qv_proj", True),
                               ("(unclosed", True)):  # fmt: skip
        assert bool(unmatched_targets({"target_modules": pattern}, spec)) == unmatched, pattern
    assert [layer_span(ls) for ls in ([3], [0, 1, 2, 3, 8], range(24))] == [
        "layer 3",
        "layers 0-3, 8",
        "layers 0-23",
    ]


# adapter -> what its refusal says (after "adapter 'NAME' (PATH): ")
ALREADY_REFUSED = {
    "no-tensors": "no LoRA tensors in adapter_model.safetensors",
    "other-module": f"tensor '{QV}.qkv_proj.lora_A.weight' targets qkv_proj, which {LLAMA} does "
    "not have",
    "wide": f"tensor '{QV}.q_proj.lora_A.weight' has shape [4, 64], the model (2 layers) needs "
    "[8, 64] at layers < 2",
}
CHANGES_NOTHING = {
    "elsewhere": f"target_modules 'qkv_proj' matches no module of {LLAMA} (its LoRA modules: "
    "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), so the adapter changes "
    "nothing in this model",
    "copies-only": f"it changes nothing in {LLAMA}: none of its tensors "
    "(base_model.model.model.embed_tokens.weight) is a LoRA factor on a module of the model",
}


@pytest.mark.parametrize("refused", [ALREADY_REFUSED, CHANGES_NOTHING], ids=["shapes", "nothing"])
def test_a_refused_adapter_costs_only_its_rows(tmp_path, tiny, zoo, monkeypatch, refused):
    """Refused by ``validate`` (its rows reported, the job still valid) and by ``run`` (its rows
    error rows naming it, the tensor or target and the reason), the other rows unharmed."""
    job = job_of(tmp_path, tiny, zoo, ["lora", *refused])
    with monkeypatch.context() as patch:
        forbid_weights(patch)
        report = validate_job(job)
        result = invoke("validate", write_job(tmp_path, tiny, adapters=job.adapters))
    assert sorted(report.broken) == sorted(refused)
    for name, reason in refused.items():
        assert report.broken[name].startswith(f"adapter {name!r} ({zoo[name]}): {reason}")
        problem = f"adapter {name!r} cannot run: adapter {name!r} ({zoo[name]}): {reason}"
        assert any(problem in p for p in report.problems)
        assert f"unusable adapter: {name}: adapter {name!r}" in result.stdout
    assert [c.name for c in report.changes] == ["lora"]
    assert result.exit_code == 0, result.stdout
    summary = run_job(job)
    assert sorted(summary.broken) == sorted(refused)
    out = {row["id"]: row for row in outputs(tmp_path / "out")}
    assert len(out) == 2 * (1 + len(refused)) + 1
    for name, reason in refused.items():
        for i in range(2):
            error = out[f"{name}-{i}"]["error"]
            assert f"row '{name}-{i}' (adapter {name!r}): " in error and reason in error
    assert all(out[i]["error"] is None for i in ("lora-0", "lora-1", "base-0"))


def test_validate_and_run_refuse_dora_under_fp8_adapters(tmp_path, tiny, zoo):
    """adapter_dtype fp8 runs no DoRA adapter: validate names it as run does, and its rows alone
    become error rows."""
    engine = {"device": "cpu", "dtype": "float32", "num_pages": PAGES, "adapter_dtype": "fp8"}
    job = job_of(tmp_path, tiny, zoo, ["lora", "dora"], engine=engine)
    report = validate_job(job)
    assert set(report.broken) == {"dora"}
    assert "DoRA is not supported with adapter_dtype fp8" in report.broken["dora"]
    summary = run_job(job)
    assert set(summary.broken) == {"dora"} and summary.stats["error_rows"] == 2
