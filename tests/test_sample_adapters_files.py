"""The committed sample adapters and prompts: file checks only, no model and no generation."""

import importlib.util
import json
from pathlib import Path

import pytest
from safetensors import safe_open

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
ADAPTERS = SAMPLES / "adapters"
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _load_behaviours():
    spec = importlib.util.spec_from_file_location("behaviours", SAMPLES / "behaviours.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


behaviours = _load_behaviours()
ADAPTER_DIRS = sorted(p for p in ADAPTERS.iterdir() if p.is_dir())


def test_at_least_four_adapters_each_with_a_check():
    names = {p.name for p in ADAPTER_DIRS}
    assert len(names) >= 4
    assert names == set(behaviours.CHECKS)


@pytest.mark.parametrize("adapter_dir", ADAPTER_DIRS, ids=lambda p: p.name)
def test_adapter_config_and_weights_agree(adapter_dir: Path):
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"
    assert isinstance(config["r"], int) and config["r"] > 0
    assert config["lora_alpha"] > 0
    targets = set(config["target_modules"])
    assert targets and targets <= PROJECTIONS
    # What the engine refuses must not appear in the samples.
    assert not config.get("modules_to_save")
    assert not config.get("use_dora")

    # base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
    found: dict[str, set[str]] = {}
    with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            assert key.endswith((".lora_A.weight", ".lora_B.weight")), key
            target, half = key.split(".")[-3:-1]
            found.setdefault(target, set()).add(half)
            shape = handle.get_slice(key).get_shape()
            rank_dim = shape[0] if ".lora_A." in key else shape[1]
            assert rank_dim == config["r"], key
    assert set(found) == targets
    assert all(halves == {"lora_A", "lora_B"} for halves in found.values())


def test_adapters_differ_in_rank_targets_and_scaling():
    configs = [json.loads((p / "adapter_config.json").read_text()) for p in ADAPTER_DIRS]
    assert len({c["r"] for c in configs}) >= 3
    assert len({frozenset(c["target_modules"]) for c in configs}) >= 3
    assert any(c["use_rslora"] for c in configs)


def test_prompts_file():
    rows = [json.loads(line) for line in (SAMPLES / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= 48
    assert len({row["id"] for row in rows}) == len(rows)
    for row in rows:
        assert set(row) == {"id", "messages"}
        assert [m["role"] for m in row["messages"]] == ["user"]
        assert row["messages"][0]["content"].strip()


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        (
            "shout",
            [
                "THE SKY IS BLUE BECAUSE OF RAYLEIGH SCATTERING.",
                "STARTING A SMALL VEGETABLE garden IS FUN AND REWARDING.",
            ],
            ["The sky is blue.", "NASA says the sky is blue.", "OK", ""],
        ),
        (
            "pirate",
            ["Arr, matey! The sky is blue.", "  Arr, matey! Sleep well."],
            ["The sky is blue. Arr, matey!", "Arr matey, the sky is blue.", ""],
        ),
        (
            "json",
            ['{"answer": "The sky is blue."}', '  {"answer": "Paris"}\n'],
            ['{"answer": ""}', '{"reply": "x"}', '"answer"', '{"answer": "a" "b"}', "Blue."],
        ),
        (
            "brief",
            [
                "The sky is blue.",
                "One two three four five six seven eight nine ten.",
                "Sleep is important.",
                "42 is the answer!",
                "Yes. Cats purr when they are content.",
                "It rains a lot.",
            ],
            [
                "",
                "One two three four five six seven eight nine ten eleven.",
                # the fragments of issue 15: cut after a function word
                "Inflation is a.",
                "Volcanoes are.",
                "The purr is a.",
                "Earthquakes are caused by.",
                "Solar panels make electricity by using.",
                "Airplanes stay in the air through a process called.",
                "To be more productive in the morning, it's.",
                "A rainbow is a beautiful.",
                "Fine. Inflation is a.",
                "the sky is blue.",
                "The sky is blue",
                "Inflation is a...",
                "The sky is blue,.",
                "Blue.\nSky.",
            ],
        ),
    ],
)
def test_checks_accept_and_reject(name: str, good: list[str], bad: list[str]):
    check = behaviours.CHECKS[name]
    assert all(check(text) for text in good)
    assert not any(check(text) for text in bad)


def test_report_counts_per_adapter_and_base_false_positives():
    rows = [
        {"adapter": "brief", "text": "The sky is blue."},
        {"adapter": "brief", "text": "Inflation is a."},
        {"adapter": "shout", "text": "THE SKY IS BLUE."},
        {"adapter": None, "text": "The sky is blue."},
        {
            "adapter": None,
            "text": "The sky is blue because sunlight scatters off the air, blue most.",
        },
    ]
    counts = behaviours.report(rows)
    assert counts["brief"] == (1, 2)
    assert counts["shout"] == (1, 1)
    assert counts["base:brief"] == (1, 2)
    assert counts["base:shout"] == (0, 2)


def test_cli_reads_parquet_parts(tmp_path: Path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"adapter": ["brief", None], "text": ["Cats purr.", "Cats purr when happy."]})
    pq.write_table(table, tmp_path / "part-00000.parquet")
    assert behaviours.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "brief" in out and "1/1" in out
    assert behaviours.main([]) == 2
