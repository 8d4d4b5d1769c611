"""The eval tests' tiny model (the jobs tests' one: 2 layers, the sample tokenizer, context 256),
four adapters and three local lm-eval tasks over JSONL: multiple_choice (a context ending in a
space: lm-eval's token-boundary rule), generate_until and loglikelihood_rolling."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from factory import ALL, make_adapter
from test_jobrun import WORDS, build_tiny

TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]
COLORS = ["red", "green", "blue", "black", "white"]
MC = """task: tiny_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/mc.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}} Answer: "
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
GEN = """task: tiny_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/gen.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} ="
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n", "."], max_gen_toks: 6, do_sample: false}}
metric_list: [{{metric: exact_match}}]
"""
PPL = """task: tiny_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/ppl.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
"""


def write_tasks(root: Path) -> Path:
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    mc = [{"question": sentence(4 + i), "choices": rng.sample(COLORS, 3), "answer": i % 3}
          for i in range(4)]  # fmt: skip
    gen = [{"question": sentence(3 + i), "answer": rng.choice(COLORS)} for i in range(3)]
    ppl = [{"text": sentence(n)} for n in (6, 15, 60)]
    for name, rows in (("mc", mc), ("gen", gen), ("ppl", ppl)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, text in (("mc", MC), ("gen", GEN), ("ppl", PPL)):
        (root / f"{name}.yaml").write_text(text.format(data=root))
    return root


@pytest.fixture(scope="session")
def eval_setup(tmp_path_factory, sample_model_dir):
    """(tiny model, adapters directory with "a", "b", "c", "d", task directory)."""
    tiny = build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)
    root = tmp_path_factory.mktemp("eval")
    adapters = root / "adapters"
    for name in ("a", "b"):
        make_adapter(tiny.model, adapters / name, *{"a": (4, ["q_proj", "v_proj"]),
                     "b": (8, ALL)}[name], 8, False, seed=ord(name))  # fmt: skip
    make_adapter(tiny.model, adapters / "c", 1, ["o_proj", "down_proj"], 4, False, seed=3)
    make_adapter(tiny.model, adapters / "d", 3, ["k_proj", "up_proj"], 6, True, seed=4)
    return tiny.model, adapters, write_tasks(root / "tasks")
