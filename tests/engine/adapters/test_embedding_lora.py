"""LoRA on embed_tokens and lm_head end to end: the engine's greedy tokens equal transformers +
PEFT in fp32 on the CPU, an adapter on each, one on both beside attention, plain LoRA and base
rows in one batch, on Qwen2 (untied) and a Llama with tied embeddings; the pages the factors take
and the refusals that name the adapter and the tensor."""

from __future__ import annotations

import pytest
import torch
from factory import edit_adapter, make_adapter, make_model, make_rows, reference
from safetensors.torch import load_file, save_file

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.store import AdapterError, AdapterStore, parse_adapter
from slora_batch.engine.models.spec import read_spec

VOCAB = 300
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (rank, targets, alpha, extra LoraConfig fields)
ADAPTERS = {
    "embed": (4, ["embed_tokens"], 8, {}),
    "head": (4, ["lm_head"], 8, {}),
    "both": (
        3,
        ["embed_tokens", "lm_head", *ATTENTION],
        6,
        dict(rank_pattern={"lm_head": 5}, alpha_pattern={"embed_tokens": 12}),
    ),
    "plain": (8, ["q_proj", "v_proj", "down_proj"], 16, {}),
}


def randomize_embedding_factors(path, seed: int) -> None:
    """PEFT starts lora_embedding_A at zero (a no-op adapter): both factors drawn at random, the
    delta of a size with the embeddings' own."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "adapter_model.safetensors")
    for key, tensor in tensors.items():
        if "lora_embedding" in key:
            std = 1.0 if key.endswith("_A") else 0.1
            tensors[key] = torch.randn(tensor.shape, generator=gen) * std
    save_file(tensors, path / "adapter_model.safetensors")


@pytest.fixture(scope="module", params=("qwen2", "gqa"))  # untied Qwen2, tied Llama
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root, request.param)
    adapters = {}
    for i, (name, (rank, targets, alpha, extra)) in enumerate(ADAPTERS.items()):
        adapters[name] = make_adapter(
            model_dir, root / name, rank, targets, alpha, False, i + 1, **extra
        )
        randomize_embedding_factors(adapters[name], seed=i)
    return model_dir, adapters


def run(model_dir, adapters, rows) -> dict:
    config = EngineConfig(device="cpu", dtype="float32", num_pages=3000, max_num_batched_tokens=64)
    engine = Engine(model_dir, adapters=adapters, config=config)
    try:
        assert not engine.broken
        results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    finally:
        engine.close()
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return {i: r.token_ids for i, r in results.items()}


def test_heads_mixed_with_plain_lora_match_peft(family):
    model_dir, adapters = family
    rows = make_rows(20, VOCAB, list(adapters), seed=7)
    got, want = run(model_dir, adapters, rows), reference(model_dir, adapters, rows)
    wrong = {i: (got[i], w) for i, w in want.items() if got[i] != w}
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"


def test_head_factors_take_pages_and_bytes(family):
    """Each head module takes r * (vocab + hidden) elements, laid over every layer of its
    pages, counted in the adapter's pages and host bytes; ranks and scales as the patterns
    give them."""
    model_dir, adapters = family
    spec = read_spec(model_dir)
    store = AdapterStore(spec, {name: adapters[name] for name in ("head", "both")})
    both = store.info("both")
    assert [(h.module, h.rank, h.scale) for h in both.heads] == [
        ("embed_tokens", 3, 4.0),
        ("lm_head", 5, 6 / 5),
    ]
    per_page = spec.num_layers * store.page_spec.page_size
    numel = 4 * (spec.vocab_size + spec.hidden_size)
    assert store.info("head").targets == ()
    assert store.pages("head") == -(-numel // per_page)
    assert store.paged("head").num_pages == store.pages("head")
    assert store.nbytes("head") == store.pages("head") * per_page * 4
    attention = store.page_spec.adapter_pages(3, ("q", "k", "v", "o"))
    heads = -(-(3 + 5) * (spec.vocab_size + spec.hidden_size) // per_page)
    assert store.pages("both") == attention + heads


def test_refusals_name_adapter_and_tensor(family, tmp_path):
    model_dir, adapters = family
    spec = read_spec(model_dir)
    key_a = "base_model.model.model.embed_tokens.lora_embedding_A"

    def short_vocab(t):
        t[key_a] = t[key_a][:, :-1].contiguous()

    bad = edit_adapter(adapters["embed"], tmp_path / "vocab", short_vocab)
    with pytest.raises(AdapterError, match=r"'vocab'.*lora_embedding_A.*\[4, 299\].*\[4, 300\]"):
        parse_adapter("vocab", bad, spec)

    key_b = "base_model.model.lm_head.lora_B.weight"
    bad = edit_adapter(adapters["head"], tmp_path / "no-b", lambda t: t.pop(key_b))
    with pytest.raises(AdapterError, match=r"'no-b'.*lm_head needs both LoRA factors"):
        parse_adapter("no-b", bad, spec)

    def wide_b(t):
        t[key_b] = torch.zeros(VOCAB, 6)

    bad = edit_adapter(adapters["head"], tmp_path / "rank", wide_b)
    with pytest.raises(AdapterError, match=r"lm_head.lora_B.weight.*\[300, 6\].*\[300, 4\]"):
        parse_adapter("rank", bad, spec)

    def other_embedding(cfg):
        cfg["target_modules"] = ["wte"]

    bad = edit_adapter(adapters["embed"], tmp_path / "wte", edit_config=other_embedding)
    with pytest.raises(AdapterError, match=r"embedding targets \['wte'\] are not supported"):
        parse_adapter("wte", bad, spec)


def test_heads_refused_under_tensor_parallelism(family):
    model_dir, adapters = family
    store = AdapterStore(read_spec(model_dir), {"both": adapters["both"]}, shard=(1, 2))
    _, broken = store.check_all()
    assert "LoRA on embed_tokens and lm_head is not supported under tensor_parallel 2" in str(
        broken["both"]
    )
