"""Which part of the engine's bf16 path drifts from fp32 on long prompts (Llama-2-7B shape, H200).

    python3 -m benchmarks.diagnose_bf16               # transformers' RoPE buffers kept fp32
    python3 -m benchmarks.diagnose_bf16 --bf16-rope   # as model.to(torch.bfloat16) leaves them

tests/test_engine_gpu.py once found the first-step logits of long prompts 2-4x further from
fp32 than transformers' bf16 is. The cause: ``model.to(torch.bfloat16)`` had rounded
transformers' rotary inv_freq buffers, so its own RoPE angles (in bf16 and fp32) were off. This prints the same error for a base row and an
adapter row at several prompt lengths, for the Triton backend, the torch backend (kernels/ref.py
on the GPU) and chunked prefill, so the cause can be told apart: base or LoRA path, kernels or
model code, one step or chunks.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from slora_batch import Engine, EngineConfig, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_gpu import (  # noqa: E402
    last_logits,
    randomize_lora,
    restore_rope,
    rope_buffers,
)

SHAPE = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
             tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=2048,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(tempfile.mkdtemp())
    config = LlamaConfig(**SHAPE)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    exact_rope = "--bf16-rope" not in sys.argv
    rope = rope_buffers(model)
    model.to(torch.bfloat16)
    if exact_rope:  # .to(bfloat16) rounds transformers' inv_freq buffers too: undo that
        restore_rope(model, rope)
    config.save_pretrained(root / "model")
    weights = dict(model.state_dict())
    peft_model = get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules=TARGETS,
                                                  lora_dropout=0.0), adapter_name="r64")  # fmt: skip
    randomize_lora(peft_model)
    peft_model.save_pretrained(root / "adapters")
    peft_model.eval()
    gen = torch.Generator().manual_seed(3)
    rows = []
    for n in (33, 130, 300):
        ids = torch.randint(3, 32000, (n,), generator=gen).tolist()
        rows += [(None, ids), ("r64", ids)]

    bf16 = [last_logits(peft_model, a, ids) for a, ids in rows]
    peft_model.float()
    exact = [last_logits(peft_model, a, ids) for a, ids in rows]
    peft_model.to(torch.bfloat16)
    if exact_rope:
        restore_rope(peft_model, rope)
    variants = {
        "triton": {},
        "torch backend": {"backend": "torch"},
        "triton, 64-token chunks": {"max_num_batched_tokens": 64},
    }
    results = {}
    for label, knobs in variants.items():
        engine = Engine(root / "model", adapters={"r64": root / "adapters" / "r64"},
                        config=EngineConfig(device="cuda", dtype="bfloat16", num_pages=20_000,
                                            max_num_seqs=16, cuda_graphs=False, **knobs),
                        weights=weights)  # fmt: skip
        results[label] = [
            engine.prompt_logits(Request(id=i, adapter=a, prompt_token_ids=ids))
            for i, (a, ids) in enumerate(rows)
        ]
        del engine
        torch.cuda.empty_cache()
    print("| prompt | adapter | transformers bf16 | " + " | ".join(variants) + " |")
    print("|---:|---|---:|" + "---:|" * len(variants))
    for i, (adapter, ids) in enumerate(rows):
        ref = exact[i]

        def err(x, ref=ref):
            return float((x - ref).norm() / ref.norm())

        cells = " | ".join(f"{err(results[label][i]):.4f}" for label in variants)
        print(f"| {len(ids)} | {adapter or 'base'} | {err(bf16[i]):.4f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
