"""LoRA on the token embedding and on the output projection in bf16 on a GPU against transformers +
PEFT (run on the device machine): adapters on embed_tokens, on lm_head and on both, each beside
attention LoRA, mixed in one batch with plain LoRA and base rows, on SmolLM2-135M's shape (Llama,
tied embeddings) and a small Qwen2 (untied). Steps whose rows include a head adapter run eagerly;
once those rows finish, the rest replay CUDA graphs. Greedy tokens equal the reference up to the
first near tie, as in test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import make_engine
from test_lora_variants_gpu import FAMILIES, assert_matches_peft, build_case, rows

pytestmark = pytest.mark.gpu

HEADS = {  # name: LoraConfig fields
    "plain": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"]),
    "embed": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "q_proj", "o_proj"]),
    "head": dict(r=16, lora_alpha=16, target_modules=["lm_head", "k_proj", "up_proj"]),
    "both": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "v_proj"]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def head_case(request, tmp_path_factory):
    case = build_case(tmp_path_factory.mktemp(request.param), FAMILIES[request.param], HEADS)
    randomize_embedding_lora(case[3])
    case[3].save_pretrained(case[2]["plain"].parent)  # the embedding factors as PEFT runs them
    return case


def randomize_embedding_lora(peft_model, seed: int = 2) -> None:
    """Non-zero embedding factors (PEFT starts lora_embedding_A at zero), rounded to bf16."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device))
            elif "lora_embedding_B" in name:
                p.copy_(0.005 * torch.randn(p.shape, generator=gen, device=p.device))
            else:
                continue
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_head_adapters_mixed_match_peft(head_case, graphs):
    model_dir, weights, adapters, peft_model = head_case
    engine = make_engine(model_dir, weights, adapters, cuda_graphs=graphs)
    cases = rows(engine.spec.vocab_size, [None, *HEADS], 15, seed=5)
    assert_matches_peft(engine, peft_model, cases)
    del engine
    torch.cuda.empty_cache()


def test_head_rows_leave_later_steps_on_graphs(head_case):
    """Rows of head adapters that finish early: every row still matches PEFT, and the steps
    after them replay CUDA graphs."""
    model_dir, weights, adapters, peft_model = head_case
    engine = make_engine(model_dir, weights, adapters, cuda_graphs=True)
    cases = rows(engine.spec.vocab_size, [None, "plain", "embed", "head"], 8, seed=7)
    for row in cases:
        if row["adapter"] in ("embed", "head"):
            row["max_new_tokens"] = 3
    assert_matches_peft(engine, peft_model, cases)
    assert engine.counters.graph_steps > 0
    del engine
    torch.cuda.empty_cache()
