"""Shared builders for the structured-output tests: a byte-level BPE tokenizer narrower than the
tiny models' logits (so the padded columns must be masked), the formats, and the reference
loop (transformers + PEFT, each step's logits masked by an xgrammar matcher, argmax, accept)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch

TOKENIZER_VOCAB = 280  # the tiny models' logits are 300 wide: ids 280..299 are no token
EOS = 2

CORPUS = (
    '{"name": "ada", "age": 36, "ok": true, "tags": ["a", "b"], "inner": {"x": 7}} '
    '{"id": "ab-123", "label": "yes", "score": 0.5, "items": [1, 2, 3], "ok": false} '
    "the quick brown fox jumps over the lazy dog; yes no maybe (42) null [] {} "
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
        },
    },
    "required": ["name", "age", "ok", "color", "tags", "inner"],
}

FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    {"type": "regex", "regex": "[a-z]{2,4}-[0-9]{3}"},
    {"type": "choice", "choice": ["yes", "no", 'maybe "so"']},
    {"type": "json_object"},
    {"type": "grammar", "grammar": 'root ::= "(" [0-9] [0-9]? ")"'},
    None,  # an unconstrained row
]


def save_tokenizer(model_dir: Path) -> None:
    """Trains a byte-level BPE tokenizer of TOKENIZER_VOCAB ids (<pad> 0, <s> 1, </s> 2, the
    256 bytes, merges from CORPUS) and saves it beside the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(model_dir)


def grammar_of(compiler, fmt):
    """The reference's compiled grammar of a format (None: unconstrained), built from the
    format's own shape, not from the engine's canonical form."""
    if fmt is None:
        return None
    kind = fmt["type"]
    if kind == "json_schema":
        return compiler.compile_json_schema(
            json.dumps(fmt["json_schema"]["schema"]), any_whitespace=False
        )
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(fmt["regex"])
    if kind == "choice":
        return compiler.compile_grammar(
            " | ".join(json.dumps(c) for c in fmt["choice"]).join(["root ::= ", ""])
        )
    return compiler.compile_grammar(fmt["grammar"])


def constrained_reference(model_dir: Path, adapters: dict, rows: list[dict]) -> dict:
    """Greedy tokens of transformers + PEFT, row by row, each step's logits masked by an
    xgrammar matcher of the row's format: HF forward (KV cache), mask, argmax, accept; a row
    ends when its matcher terminates (constrained) or on EOS (unconstrained)."""
    import xgrammar as xgr
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = base.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab, stop_token_ids=[EOS]
    )
    compiler = xgr.GrammarCompiler(info)
    # JSON allows no raw control character (xgrammar's bounded strings do): JSON rows never
    # draw a token holding one
    controls = [t for t, piece in enumerate(info.decoded_vocab) if any(b < 0x20 for b in piece)]
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    out = {}
    for row in rows:
        grammar = grammar_of(compiler, row.get("response_format"))
        matcher = xgr.GrammarMatcher(grammar) if grammar is not None else None
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        if row["adapter"]:
            model.set_adapter(row["adapter"])
        tokens, past = [], None
        feed = torch.tensor([row["prompt_token_ids"]])
        with torch.no_grad(), model.disable_adapter() if not row["adapter"] else nullcontext():
            for _ in range(row["max_new_tokens"]):
                step = model(input_ids=feed, past_key_values=past, use_cache=True)
                past, logits = step.past_key_values, step.logits[:, -1].clone()
                if matcher is not None:
                    matcher.fill_next_token_bitmask(bitmask)
                    xgr.apply_token_bitmask_inplace(logits, bitmask)
                    if row["response_format"]["type"] in ("json_object", "json_schema"):
                        logits[:, controls] = float("-inf")
                token = int(logits.argmax(dim=-1))
                tokens.append(token)
                if matcher is not None:
                    assert matcher.accept_token(token)
                    if matcher.is_terminated():
                        break
                elif token == EOS:
                    break
                feed = torch.tensor([[token]])
        out[row["id"]] = tokens
    return out


def structured_case(root: Path) -> tuple[Path, dict]:
    """A tiny GQA model with the narrow tokenizer, and two adapters."""
    from factory import make_adapter, make_model

    model_dir = make_model(root, "gqa", seed=3)
    save_tokenizer(model_dir)
    adapters = {
        "r4": make_adapter(model_dir, root / "r4", 4, ["q_proj", "v_proj"], 8, False, seed=5),
        "r8": make_adapter(model_dir, root / "r8", 8, ["o_proj", "down_proj"], 16, False, seed=6),
    }
    return model_dir, adapters
