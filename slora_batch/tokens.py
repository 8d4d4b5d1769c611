"""The tokenizer side: loading it from the model directory, and stop strings on decoded text."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: Path):
    """The model's Hugging Face tokenizer, or None when the directory ships none."""
    if not any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class Detokenizer:
    """Decodes a row's output ids and finds stop strings in the text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def find_stop(self, ids: list[int], stops: list[str]) -> bool:
        # A stop string can only complete within the text of the last token or the ones before it,
        # so decoding a tail as long as the longest stop string (in tokens, at worst 1 char each)
        # suffices.
        tail = ids[-(max(map(len, stops)) + 1) :]
        text = self.text(tail)
        return any(stop in text for stop in stops)

    def final_text(self, ids: list[int], stops: list[str]) -> str:
        """The whole output text, cut before the first stop string."""
        text = self.text(ids)
        cuts = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        return text[: min(cuts)] if cuts else text


PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


def tokenize(request, tokenizer, vocab_size: int, model: object = "the model") -> list[int]:
    """A request's prompt ids: its token ids as given, its text with the tokenizer's BOS rule,
    or its chat messages through the model's chat template. Raises ValueError / TypeError."""
    given = [name for name in PROMPT_FIELDS if getattr(request, name) is not None]
    if len(given) != 1:
        raise ValueError(
            f"exactly one of prompt, messages, prompt_token_ids is needed, got {given or 'none'}"
        )
    if request.prompt_token_ids is not None:
        ids = [int(t) for t in request.prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:3]} outside the vocabulary of {vocab_size}")
        return ids
    if tokenizer is None:
        raise ValueError(f"model {model} has no tokenizer: pass prompt_token_ids")
    if request.prompt is not None:
        if not isinstance(request.prompt, str):
            raise TypeError(f"prompt must be a string, got {type(request.prompt).__name__}")
        return tokenizer(request.prompt)["input_ids"] if request.prompt else []
    return tokenizer.apply_chat_template(
        request.messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
