"""PEFT's modules_to_save (trained copies of embed_tokens and lm_head) end to end: the engine's
greedy tokens equal transformers + PEFT in fp32 on the CPU, each kind alone and all mixed with
plain LoRA and base rows in one batch, on Qwen2 and on a Llama with tied embeddings; the pages
a copy takes; the refusals that name the adapter, the module or tensor and the reason, whose
rows become error rows while the others run; an adapter whose copies never fit the pool."""

from __future__ import annotations

import pytest
import torch
from factory import (
    edit_adapter,
    make_adapter,
    make_model,
    make_rows,
    randomize_heads,
    reference_each,
)

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.store import AdapterError, AdapterStore, parse_adapter
from slora_batch.engine.models.spec import read_spec

VOCAB = 300
FAMILIES = ("qwen2", "gqa")  # Qwen2 (untied), the factory's Llama with tied embeddings
HEAD_KEY = "base_model.model.lm_head.weight"
EMBED_KEY = "base_model.model.model.embed_tokens.weight"
# name -> (rank, LoRA targets, alpha, modules_to_save)
ADAPTERS = {
    "head": (4, ["q_proj", "v_proj"], 8, ["lm_head"]),
    "embed": (3, ["q_proj", "o_proj"], 6, ["embed_tokens"]),
    "both": (2, ["down_proj"], 4, ["model.embed_tokens", "lm_head"]),
    "lora-embed": (4, ["embed_tokens", "k_proj"], 8, ["lm_head"]),  # LoRA on one, a copy of other
    "plain": (8, ["q_proj", "v_proj", "down_proj"], 16, None),
}
SAVED = ("head", "embed", "both", "lora-embed")


def make_saved_adapter(model_dir, out, rank, targets, alpha, modules_to_save, seed):
    """A PEFT adapter with random LoRA factors and ``modules_to_save`` copies drawn at random
    (``factory.randomize_heads``), so that their rows' tokens differ from the base model's."""
    extra = {"modules_to_save": modules_to_save} if modules_to_save else {}
    make_adapter(model_dir, out, rank, targets, alpha, False, seed, **extra)
    return randomize_heads(out, seed)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root, request.param)
    adapters = {
        name: make_saved_adapter(model_dir, root / name, *fields, seed=i + 1)
        for i, (name, fields) in enumerate(ADAPTERS.items())
    }
    return model_dir, adapters


def engine(model_dir, adapters, **knobs) -> Engine:
    knobs = {"num_pages": 3000, **knobs}
    config = EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=64, **knobs)
    return Engine(model_dir, adapters=adapters, config=config)


def generate(model_dir, adapters, rows, **knobs) -> dict:
    """The engine's results per row id."""
    run = engine(model_dir, adapters, **knobs)
    try:
        return {r.id: r for r in run.generate(Request(**row) for row in rows)}
    finally:
        run.close()


def assert_parity(model_dir, adapters, rows) -> None:
    got = generate(model_dir, adapters, rows)
    assert all(r.error is None for r in got.values()), [r.error for r in got.values()]
    want = reference_each(model_dir, adapters, rows)
    wrong = {i: (got[i].token_ids, w) for i, w in want.items() if got[i].token_ids != w}
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"


@pytest.mark.parametrize("name", SAVED)
def test_saved_modules_alone_match_peft(family, name):
    model_dir, adapters = family
    rows = make_rows(6, VOCAB, [name], seed=3)  # rows 0 and 5 on the base model
    assert_parity(model_dir, {name: adapters[name]}, rows)


def test_saved_modules_mixed_with_plain_lora_and_base_rows_match_peft(family):
    model_dir, adapters = family
    assert_parity(model_dir, adapters, make_rows(20, VOCAB, list(adapters), seed=7))


def test_saved_copies_give_peft_logits(family):
    """The next-token logits after a prompt, per adapter with saved copies, equal PEFT's in
    fp32 (the copies replace whole rows of logits and of input embeddings: any slip shows)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapters = family
    prompt = [7, 44, 12, 250, 3, 99]
    run = engine(model_dir, {n: adapters[n] for n in SAVED})
    try:
        got = {
            n: run.prompt_logits(Request(id=0, adapter=n, prompt_token_ids=prompt)) for n in SAVED
        }
    finally:
        run.close()
    for name in SAVED:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapters[name]).eval()
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-4, msg=name)


def test_saved_copies_change_the_tokens(family):
    """The copies are used: a prompt's greedy tokens on an adapter with a saved lm_head (and
    no other change that could matter as much) differ from the base model's."""
    model_dir, adapters = family
    prompt = [5, 17, 33, 8, 91]
    rows = [
        dict(id=i, adapter=a, prompt_token_ids=prompt, max_new_tokens=8, ignore_eos=True)
        for i, a in enumerate([None, "head", "embed"])
    ]
    got = generate(model_dir, adapters, rows)
    assert got[1].token_ids != got[0].token_ids and got[2].token_ids != got[0].token_ids


def test_saved_copies_take_pages_and_bytes(family):
    """A saved copy takes vocab * hidden elements, beside any head LoRA in one block laid over
    every layer of its pages, counted in the adapter's pages and host bytes."""
    model_dir, adapters = family
    spec = read_spec(model_dir)
    store = AdapterStore(spec, {n: adapters[n] for n in ("both", "lora-embed")})
    both, mixed = store.info("both"), store.info("lora-embed")
    assert [(h.module, h.saved) for h in both.heads] == [("embed_tokens", True), ("lm_head", True)]
    assert [(h.module, h.rank, h.saved) for h in mixed.heads] == [
        ("embed_tokens", 4, False),
        ("lm_head", 0, True),
    ]
    per_page = spec.num_layers * store.page_spec.page_size
    copy = spec.vocab_size * spec.hidden_size
    down = store.page_spec.adapter_pages(2, ("down",))
    assert store.pages("both") == down + -(-2 * copy // per_page)
    assert store.paged("both").num_pages == store.pages("both")
    assert store.nbytes("both") == store.pages("both") * per_page * 4
    embed_lora = 4 * (spec.vocab_size + spec.hidden_size)
    k = store.page_spec.adapter_pages(4, ("k",))
    assert store.pages("lora-embed") == k + -(-(embed_lora + copy) // per_page)


def test_slot_table_lists_the_pages_the_lora_kernels_read(family):
    """The device's slot table is as wide as the largest adapter's linear-target pages: a
    head block (here two [V, H] copies) is found through its own page list, not the table."""
    model_dir, adapters = family
    used = {n: adapters[n] for n in ("both", "head")}
    run = engine(model_dir, used)
    try:
        rows = [Request(id=i, adapter=n, prompt_token_ids=[5, 6], max_new_tokens=2)
                for i, n in enumerate(used)]  # fmt: skip
        assert all(r.error is None for r in run.generate(rows))
        page_spec = run.residency.store.page_spec
        linear = [page_spec.adapter_pages(2, ("down",)), page_spec.adapter_pages(4, ("q", "v"))]
        assert run.residency.slot_pages.shape[1] == max(linear)
        assert run.residency.store.pages("both") > 2 * max(linear)
    finally:
        run.close()


def bad_adapters(adapters, root) -> dict[str, tuple]:
    """name -> (path, what its refusal says): copies of good adapters broken one way each."""

    def config(**fields):
        return lambda cfg: cfg.update(fields)

    def short_vocab(t):
        t[HEAD_KEY] = t[HEAD_KEY][:-1].contiguous()

    def drop_copy(t):
        del t[EMBED_KEY]

    cases = {
        "score": (adapters["head"], None, config(modules_to_save=["score"]),
                  r"modules_to_save 'score' is not supported"),
        "norm": (adapters["head"], None, config(modules_to_save=["lm_head", "model.norm"]),
                 r"modules_to_save 'model.norm' is not supported"),
        "vocab": (adapters["head"], short_vocab, None,
                  rf"modules_to_save lm_head: tensor '{HEAD_KEY}' has shape \[299, 64\], "
                  r"the model's lm_head is \[300, 64\]"),
        "missing": (adapters["both"], drop_copy, None,
                    r"modules_to_save embed_tokens: no tensor 'model.embed_tokens.weight'"),
        "twice": (adapters["lora-embed"], None,
                  config(modules_to_save=["lm_head", "embed_tokens"]),
                  r"embed_tokens is both in modules_to_save and a LoRA target"),
    }  # fmt: skip
    return {
        name: (edit_adapter(src, root / name, tensors, cfg), match)
        for name, (src, tensors, cfg, match) in cases.items()
    }


def test_refusals_name_the_adapter_the_module_and_the_reason(family, tmp_path):
    model_dir, adapters = family
    spec = read_spec(model_dir)
    for name, (path, match) in bad_adapters(adapters, tmp_path).items():
        with pytest.raises(AdapterError, match=rf"'{name}'.*{match}"):
            parse_adapter(name, path, spec)


def test_ensure_weight_tying_refused_on_tied_embeddings_only(family, tmp_path):
    """PEFT's ensure_weight_tying ties the saved embed_tokens and lm_head copies of a model with
    tied embeddings (refused); on an untied model it changes nothing (runs)."""
    model_dir, adapters = family
    spec = read_spec(model_dir)
    path = edit_adapter(adapters["embed"], tmp_path / "tie", edit_config=lambda c: c.update(
        ensure_weight_tying=True))  # fmt: skip
    if spec.tie_word_embeddings:
        with pytest.raises(AdapterError, match=r"'tie'.*ensure_weight_tying on a model with tied"):
            parse_adapter("tie", path, spec)
    else:
        assert parse_adapter("tie", path, spec).heads[0].saved


def test_refused_adapters_rows_are_error_rows_and_the_others_run(family, tmp_path):
    model_dir, adapters = family
    bad = bad_adapters(adapters, tmp_path)
    good = {n: adapters[n] for n in ("head", "plain")}
    names = ["head", "plain", *bad]
    rows = make_rows(14, VOCAB, names, seed=11)
    got = generate(model_dir, {**good, **{n: p for n, (p, _) in bad.items()}}, rows)
    for row in rows:
        result = got[row["id"]]
        if row["adapter"] in bad:
            assert result.finish_reason == "error"
            assert f"'{row['adapter']}'" in result.error and "modules_to_save" in result.error
        else:
            assert result.error is None, result.error
    alone = generate(model_dir, good, [r for r in rows if r["adapter"] not in bad])
    assert {i: r.token_ids for i, r in alone.items()} == {i: got[i].token_ids for i in alone}


def test_an_adapter_whose_copies_never_fit_the_pool_fails_its_rows_alone(family):
    """A pool smaller than the adapter with both copies (600 of its pages on the tiny models)
    but large enough for the other rows: its rows are error rows giving the sizes; the rows of
    the adapter with one copy and of plain LoRA run and match those of a roomy pool."""
    model_dir, adapters = family
    spec = read_spec(model_dir)
    used = {n: adapters[n] for n in ("both", "head", "plain")}
    pages = AdapterStore(spec, used).pages("both") - 1
    rows = [
        dict(id=i, adapter=a, prompt_token_ids=[4 + i, 9, 12], max_new_tokens=3)
        for i, a in enumerate(["both", "head", "plain", None, "both", "head"])
    ]
    got = generate(model_dir, used, rows, num_pages=pages)
    for row in rows:
        result = got[row["id"]]
        if row["adapter"] == "both":
            assert result.finish_reason == "error"
            assert f"adapter {pages + 1}), the pool has {pages}" in result.error
        else:
            assert result.error is None, result.error
    roomy = generate(model_dir, used, [r for r in rows if r["adapter"] != "both"])
    assert {i: r.token_ids for i, r in roomy.items()} == {i: got[i].token_ids for i in roomy}


def test_saved_modules_refused_under_tensor_parallelism(family):
    model_dir, adapters = family
    store = AdapterStore(read_spec(model_dir), {"head": adapters["head"]}, shard=(1, 2))
    _, broken = store.check_all()
    assert "lm_head is not supported under tensor_parallel 2" in str(broken["head"])


def test_block_elements_gathered_from_pages_placed_at_random():
    """A head block laid layer-major over pages at random places in the pool reads back the
    same through a range gather and an element gather, at ranges that start and end inside
    pages."""
    from slora_batch.engine.adapters.head_weights import SlotHeads

    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(3, 40, 8, generator=gen)  # [L, pages, page]
    pages = torch.randperm(40, generator=gen)[:5]
    slot = SlotHeads(pages, ())
    block = pool[:, pages].reshape(-1)  # the block's 3 * 5 * 8 elements in their order
    for start, stop in ((0, 120), (3, 4), (9, 15), (37, 101)):
        assert torch.equal(slot.gather(pool, start, stop), block[start:stop])
    index = torch.randint(0, 120, (6, 7), generator=gen)
    assert torch.equal(slot.elements(pool, index), block[index])


def test_saved_copies_read_in_slices_match_peft(family, monkeypatch):
    """A saved lm_head gathered a few vocabulary rows at a time, and a saved embedding's rows a
    few tokens at a time (slices that do not divide the vocabulary or the tokens), give PEFT's
    tokens."""
    from slora_batch.engine.adapters import head_weights

    model_dir, adapters = family
    monkeypatch.setattr(head_weights, "GATHER_ELEMENTS", 7 * 64)
    monkeypatch.setattr(head_weights, "INDEX_ELEMENTS", 3 * 64)
    names = ["both", "lora-embed"]
    assert_parity(model_dir, {n: adapters[n] for n in names}, make_rows(8, VOCAB, names, seed=5))


# bf16 on a GPU (the device machine): the tests of test_lora_variants_gpu.py's families
GPU_ADAPTERS = {  # name: LoraConfig fields
    "plain": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"]),
    "head": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj"],
                 modules_to_save=["lm_head"]),
    "embed": dict(r=8, lora_alpha=16, target_modules=["o_proj", "up_proj"],
                  modules_to_save=["embed_tokens"]),
    "both": dict(r=4, lora_alpha=8, target_modules=["v_proj"],
                 modules_to_save=["embed_tokens", "lm_head"]),
}  # fmt: skip


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2"])  # tied Llama, untied Qwen2
def gpu_case(request, tmp_path_factory):
    """test_lora_variants_gpu's bf16 model and PEFT model with ``GPU_ADAPTERS``, the saved
    copies moved off the base weights by noise of their own size (PEFT starts them equal)."""
    from test_lora_variants_gpu import FAMILIES, build_case

    case = build_case(tmp_path_factory.mktemp(request.param), FAMILIES[request.param], GPU_ADAPTERS)
    peft_model, adapters = case[3], case[2]
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                noise = torch.randn(p.shape, generator=gen, device=p.device) * 0.02
                p.add_(noise.to(p.dtype))
    peft_model.save_pretrained(adapters["plain"].parent)
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_saved_modules_mixed_match_peft(gpu_case, graphs):
    """Rows of saved lm_head and embed_tokens copies, plain LoRA and the base model in one
    batch: first-step logits near fp32's as transformers' own bf16 are, tokens equal up to
    a near tie; steps with saved copies run eagerly, the others may replay CUDA graphs."""
    from test_engine_gpu import make_engine
    from test_lora_variants_gpu import assert_matches_peft
    from test_lora_variants_gpu import rows as gpu_rows

    model_dir, weights, adapters, peft_model = gpu_case
    engine = make_engine(model_dir, weights, adapters, cuda_graphs=graphs)
    cases = gpu_rows(engine.spec.vocab_size, [None, *GPU_ADAPTERS], 15, seed=5)
    assert_matches_peft(engine, peft_model, cases)
    del engine
    torch.cuda.empty_cache()
