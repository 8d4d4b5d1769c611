"""Tiny random models and adapters in Hugging Face / PEFT format, and the reference generations."""

from __future__ import annotations

import random
from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]

# (name, rank, targets, alpha, rslora): ranks 1, 3, 8, 16, 64; attention-only and all-linear.
ADAPTERS = [
    ("r1-attn", 1, ["q_proj", "v_proj"], 2, False),
    ("r3-all", 3, ALL, 6, False),
    ("r8-attn", 8, ATTN, 16, False),
    ("r16-all-rs", 16, ALL, 8, True),
    ("r64-mlp", 64, ["gate_proj", "up_proj", "down_proj", "k_proj"], 32, False),
    ("r5-qo", 5, ["q_proj", "o_proj"], 5, False),
]

KINDS = (
    "mha",
    "gqa",
    "qwen2",
)  # Mistral, Gemma, Phi-3, Qwen3: tests/engine/models/test_families.py


def tiny_spec(**overrides):
    """A ModelSpec for tests that need no weights (2 layers, hidden 64, GQA 4/2, head_dim 16)."""
    from slora_batch.engine.models.spec import ModelSpec

    fields = dict(path="tiny", architecture="LlamaForCausalLM", vocab_size=50, hidden_size=64,
                  intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                  max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
                  o_bias=False, sliding_window=None, eos_token_ids=(2,), bos_token_id=1)  # fmt: skip
    return ModelSpec(**{**fields, **overrides})


def model_config(kind: str, layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "mha":
        return LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            **common,
        )
    if kind == "gqa":
        return LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **common,
        )
    if kind == "qwen2":
        return Qwen2Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=False,
            **common,
        )
    raise ValueError(kind)


def make_model(root: Path, kind: str, seed: int = 0, layers: int = 2) -> Path:
    """The tiny model of ``kind`` (2 layers; ``layers`` others: the Triton interpreter's tests,
    whose time goes by the kernels a step launches) under ``root``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(kind, layers), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    out = root / (f"model-{kind}" if layers == 2 else f"model-{kind}-{layers}-layers")
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_adapter(
    model_dir: Path,
    out: Path,
    rank: int,
    targets: list[str],
    alpha: float,
    rslora: bool,
    seed: int,
    **extra,
) -> Path:
    """A PEFT LoRA adapter with random non-zero A and B (PEFT's default B = 0 is a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        lora_dropout=0.0,
        **extra,
    )
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.normal_(0, 0.5 / max(1, rank) ** 0.5)
    peft_model.save_pretrained(out)
    return out


def make_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: make_adapter(model_dir, root / name, r, t, a, rs, seed=i + 1)
        for i, (name, r, t, a, rs) in enumerate(ADAPTERS)
    }


def gqa_with_adapters(root: Path, count: int) -> tuple[Path, dict[str, Path]]:
    """The tiny GQA model and ``count`` adapters a0, a1, ... of ranks 2, 3, ... on q and v."""
    model_dir = make_model(root, "gqa")
    adapters = {
        f"a{i}": make_adapter(
            model_dir,
            root / f"a{i}",
            rank=2 + i,
            targets=["q_proj", "v_proj"],
            alpha=4,
            rslora=False,
            seed=i,
        )  # fmt: skip
        for i in range(count)
    }
    return model_dir, adapters


def make_rows(n: int, vocab: int, adapters: list[str], seed: int = 0) -> list[dict]:
    """Rows with varied prompt lengths and max_new_tokens; every fifth on the base model."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.choice([1, 2, 5, 9, 17, 33, 50, 70])
        rows.append(
            {
                "id": i,
                "adapter": None if i % 5 == 0 else adapters[i % len(adapters)],
                "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)],
                "max_new_tokens": rng.choice([1, 3, 8, 16, 24]),
            }
        )
    return rows


def reference(model_dir: Path, adapters: dict[str, Path], rows: list[dict]) -> dict:
    """Greedy generations of transformers + PEFT, row by row (the adapter set per row)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    eos = base.config.eos_token_id
    out = {}
    for row in rows:
        ids = torch.tensor([row["prompt_token_ids"]])
        kwargs = dict(
            max_new_tokens=row["max_new_tokens"],
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        with torch.no_grad():
            if row["adapter"]:
                model.set_adapter(row["adapter"])
                gen = model.generate(input_ids=ids, **kwargs)
            else:
                with model.disable_adapter():
                    gen = model.generate(input_ids=ids, **kwargs)
        tokens = gen[0, ids.shape[1] :].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        out[row["id"]] = tokens
    return out


def edit_adapter(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of adapter ``src`` at ``dst``, its tensors (name -> tensor) and its config edited
    in place by ``edit_tensors`` and ``edit_config`` where given."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "adapter_model.safetensors")
    cfg = json.loads((src / "adapter_config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    dst.mkdir(parents=True)
    save_file(tensors, dst / "adapter_model.safetensors")
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def rewrite_adapter(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of adapter ``src`` at ``dst``: its config updated with ``config``, its tensors
    (name -> tensor) replaced by ``tensors(old)`` where given."""

    def replace(weights: dict) -> None:
        if tensors:
            new = tensors(dict(weights))
            weights.clear()
            weights.update(new)

    return edit_adapter(src, dst, replace, lambda cfg: cfg.update(config or {}))


def randomize_heads(path: Path, seed: int) -> Path:
    """An adapter's head tensors drawn at random, so that its rows' tokens differ from the base
    model's: LoRA on embed_tokens (PEFT starts lora_embedding_A at zero, a no-op) and the
    trained copies of ``modules_to_save`` (PEFT saves the base's own values) at the scale of
    the base weights."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "adapter_model.safetensors")
    for key, tensor in tensors.items():
        if key.endswith(("model.lm_head.weight", "model.embed_tokens.weight")):
            tensors[key] = torch.randn(tensor.shape, generator=gen) * 0.2
        elif "lora_embedding" in key:
            std = 1.0 if key.endswith("_A") else 0.1
            tensors[key] = torch.randn(tensor.shape, generator=gen) * std
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def reference_each(model_dir: Path, adapters: dict[str, Path], rows: list[dict]) -> dict:
    """``reference`` with a PeftModel per adapter (the base rows with the first one's): PEFT
    cannot load an adapter with LoRA on a module that another loaded adapter saves a copy of,
    which the engine runs side by side."""
    want = {}
    for name, path in adapters.items():
        mine = [r for r in rows if r["adapter"] == name]
        if name == next(iter(adapters)):
            mine += [r for r in rows if r["adapter"] is None]
        want.update(reference(model_dir, {name: path}, mine) if mine else {})
    return want


def round_kv_writes(monkeypatch, kv_heads: int) -> None:
    """The torch twin's kv_write rounds each K/V row through e4m3 (as fp8 pages hold it) before
    writing it to full-precision pages, in place: the step's own rows, which the prefill
    attention reads beside the pages, are rounded too. A full-precision cache so fed differs
    from fp8 pages by nothing but where the rounding happens."""
    from slora_kernels import fp8, ref

    write = ref.kv_write

    def rounded_write(pool_layer, k, v, out_pages):
        for x in (k, v):
            x.copy_(fp8.dequantize(*fp8.quantize(x, kv_heads)))
        write(pool_layer, k, v, out_pages)

    monkeypatch.setattr(ref, "kv_write", rounded_write)
