"""A text-scored row's tokens with SmolLM2's tokenizer (the sample model's): lm-eval's rule moves a
prompt's trailing whitespace into each continuation, so " Paris" after "The capital is" is one
token ("ĠParis"), not "Ġ" then "Paris"; the boundary rule otherwise; chat contexts untouched."""

from __future__ import annotations

import pytest

from slora_batch.engine.requests.request import Request
from slora_batch.engine.requests.scoring import scored_ids
from slora_batch.engine.requests.tokens import tokenize


@pytest.fixture(scope="module")
def tokenizer(sample_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sample_model_dir)


def split(tokenizer, **fields) -> tuple[list[str], list[list[str]]]:
    """The context's and each continuation's tokens, as the engine scores the row."""
    request = Request(id=1, **fields)
    context = tokenize(request, tokenizer, len(tokenizer))
    context, continuations = scored_ids(request, context, tokenizer, len(tokenizer))
    names = tokenizer.convert_ids_to_tokens
    return names(context), [names(ids) for ids in continuations]


def test_a_prompt_s_trailing_whitespace_moves_into_the_continuations(tokenizer):
    context, (paris, rome) = split(tokenizer, prompt="The capital of France is ",
                                   choices=["Paris", "Rome"])  # fmt: skip
    assert context == tokenizer.convert_ids_to_tokens(
        tokenizer("The capital of France is")["input_ids"]
    )
    assert paris == ["ĠParis"] and rome == ["ĠRome"]
    # the same as a context without the space and continuations with it
    assert split(tokenizer, prompt="The capital of France is", choices=[" Paris", " Rome"]) == (
        context, [paris, rome]
    )  # fmt: skip
    # several whitespace characters move together; a continuation row alike
    many, [ids] = split(tokenizer, prompt="Q: 2+2?\nA:\n ", continuation="4")
    whole = tokenizer("Q: 2+2?\nA:\n 4")["input_ids"]
    assert tokenizer.convert_tokens_to_ids(many + ids) == whole
    assert many == tokenizer.convert_ids_to_tokens(tokenizer("Q: 2+2?\nA:")["input_ids"])


def test_a_chat_context_and_given_ids_are_left_as_they_are(tokenizer):
    messages = [{"role": "user", "content": "Capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("\n")  # the template's generation prompt ends in a newline
    context, [ids] = split(tokenizer, messages=messages, continuation="Paris")
    assert tokenizer.convert_tokens_to_ids(context) == tokenize(
        Request(id=1, messages=messages), tokenizer, len(tokenizer)
    )
    assert ids == ["Paris"]
    given, [cont] = split(tokenizer, prompt_token_ids=[5, 6, 220], continuation_token_ids=[7])
    assert tokenizer.convert_tokens_to_ids(given) == [
        5,
        6,
        220,
    ] and cont == tokenizer.convert_ids_to_tokens([7])
