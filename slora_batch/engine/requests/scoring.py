"""Scored rows: a context and one or more continuations whose log-probabilities are read, nothing
sampled; and the log-probabilities of generated tokens.

Each continuation becomes one prefill-only sequence of context + continuation tokens that runs in
the same batches and LoRA kernels as generated rows. Its step computes a log-softmax only at the
positions that predict a continuation token (``batch.plan_step`` lists them), and the engine
writes each token's log-probability and whether it was the argmax into the sequence
(``ScoreBuffer``). A row with choices runs one sequence per choice; ``ChoiceGroup`` joins them
back into one result.

Tokenization, as evaluation harnesses do it: a text context's trailing whitespace moves into each
continuation (lm-eval's rule: "Paris?" after "The capital is " is scored as " Paris?" after "The
capital is", one natural token "ĠParis" rather than "Ġ" then "Paris"); then the context's tokens,
then the whole text (context + continuation) encoded and split at the context's token count. When
a token spans the boundary (the whole's tokens do not start with the context's), the continuation
is encoded on its own and appended to the context's tokens instead, so the context is always
scored as it is tokenized alone. A chat context keeps the template's generation prompt whole (its
trailing newline is the template's, a token of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slora_batch.engine.requests.request import Request, Result

MAX_LOGPROBS = 20


@dataclass
class ScoreBuffer:
    """Per continuation token: its log-probability and whether it was the most likely token.

    A scored sequence is fed its context and every continuation token but the last (``last``):
    no position predicts from the last token, so computing it would be waste, and a pair of
    ``max_model_len + 1`` tokens fits, as in transformers' (lm-eval ``hf``'s) scoring."""

    start: int  # index of the first continuation token in the sequence's prompt_ids
    last: int  # the last continuation token, never fed: the target of the last position
    logprobs: np.ndarray  # [n] float64
    greedy: np.ndarray  # [n] bool

    @classmethod
    def empty(cls, start: int, continuation: list[int]) -> ScoreBuffer:
        n = len(continuation)
        return cls(start, continuation[-1], np.zeros(n, dtype=np.float64), np.zeros(n, dtype=bool))

    def targets(self, prompt_ids: list[int], lo: int, hi: int) -> list[int]:
        """The tokens that positions ``lo`` to ``hi`` - 1 of the sequence (fed ``prompt_ids``)
        predict: the fed tokens after them, then ``last`` for the last fed position."""
        out = prompt_ids[lo + 1 : hi + 1]
        if hi == len(prompt_ids) and hi > lo:
            out.append(self.last)
        return out


@dataclass(eq=False)
class ChoiceGroup:
    """The sequences of one row's choices; complete when each has its scores."""

    request: Request
    count: int
    done: dict[int, ScoreBuffer] = field(default_factory=dict)

    def add(self, index: int, scores: ScoreBuffer) -> bool:
        self.done[index] = scores
        return len(self.done) == self.count


def scored_ids(
    request: Request, context: list[int], tokenizer, vocab_size: int
) -> tuple[list[int], list[list[int]]]:
    """A scored row's context ids and the token ids of each continuation (one list per choice,
    or one for a ``continuation``), from its prompt ids ``context`` as ``tokens.tokenize`` gives
    them: a text prompt ending in whitespace is tokenized without it, and the whitespace leads
    each continuation (the module docstring says why). Raises ValueError / TypeError naming what
    is wrong."""
    if request.continuation_token_ids is not None or request.choices_token_ids is not None:
        return context, _given_ids(request, vocab_size)
    texts = _continuation_texts(request)
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: pass continuation_token_ids")
    context_text = _context_text(request, tokenizer)
    if request.prompt is not None:
        context_text, texts, context = _space_to_continuations(
            tokenizer, context_text, texts, context
        )
    special = request.prompt is not None
    return context, [_text_ids(tokenizer, context_text, context, text, special) for text in texts]


def _given_ids(request: Request, vocab_size: int) -> list[list[int]]:
    """The continuations given as token ids, checked against the vocabulary."""
    given = (
        [request.continuation_token_ids]
        if request.continuation_token_ids is not None
        else request.choices_token_ids
    )
    if not isinstance(given, list) or not given:
        raise ValueError("choices_token_ids must be a non-empty list of token id lists")
    out = []
    for i, ids in enumerate(given):
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError(f"continuation {i} has no tokens")
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"continuation {i}: token ids {bad[:3]} outside the vocabulary")
        out.append(ids)
    return out


def _continuation_texts(request: Request) -> list[str]:
    """The continuations given as text: a non-empty list of non-empty strings."""
    texts = [request.continuation] if request.continuation is not None else request.choices
    if not isinstance(texts, list) or not texts:
        raise ValueError("choices must be a non-empty list of strings")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"choice {i} must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{'continuation' if len(texts) == 1 else f'choice {i}'} is empty")
    return texts


def _space_to_continuations(
    tokenizer, context_text: str, texts: list[str], context: list[int]
) -> tuple[str, list[str], list[int]]:
    """A text prompt's trailing whitespace moved to the front of each continuation, and the
    context re-encoded without it: ("The capital is ", ["Paris"]) becomes ("The capital is",
    [" Paris"]). An all-whitespace prompt stays the context."""
    stripped = context_text.rstrip()
    if not stripped or stripped == context_text:
        return context_text, texts, context
    space = context_text[len(stripped) :]
    return stripped, [space + text for text in texts], _encode(tokenizer, stripped, True)


def _text_ids(
    tokenizer, context_text: str | None, context: list[int], text: str, special: bool
) -> list[int]:
    """One continuation's ids: the whole (context + continuation) encoded and split at the
    context's token count, or the continuation encoded alone when a token spans the boundary or
    the context was given as ids."""
    ids = None
    if context_text is not None:
        whole = _encode(tokenizer, context_text + text, special)
        if whole[: len(context)] == context and len(whole) > len(context):
            ids = whole[len(context) :]
    if ids is None:
        ids = _encode(tokenizer, text, False)
    if not ids:
        raise ValueError(f"continuation {text!r} encodes to no tokens")
    return ids


def answer_index(request: Request, count: int) -> int | None:
    """The index of the row's answer among its choices (None without one). A continuation row
    is one choice: its answer is 0 or the continuation's text, and ``correct`` says whether the
    continuation is the greedy one."""
    answer = request.answer
    if answer is None:
        return None
    if request.choices is None and request.choices_token_ids is None:
        zero = isinstance(answer, int) and not isinstance(answer, bool) and answer == 0
        if zero or (request.continuation is not None and answer == request.continuation):
            return 0
        allowed = "0 or the continuation's text" if request.continuation is not None else "0"
        raise ValueError(
            f"answer on a continuation row must be {allowed} (correct then says whether the "
            f"continuation is the model's greedy one), got {answer!r}"
        )
    if isinstance(answer, bool) or not isinstance(answer, int | str):
        raise TypeError(f"answer must be a choice index or a choice, got {type(answer).__name__}")
    if isinstance(answer, int):
        if not 0 <= answer < count:
            raise ValueError(f"answer {answer} is not a choice index (0 to {count - 1})")
        return answer
    texts = request.choices or [request.continuation]
    if answer not in texts:
        raise ValueError(f"answer {answer!r} is not among the choices")
    return texts.index(answer)


def check_logprobs(request: Request) -> int | None:
    """The row's logprobs: None when not asked, else the number of alternatives (0 to 20)."""
    k = request.logprobs
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {k!r}")
    if request.scored:
        raise ValueError("logprobs is for generated rows; a scored row has its token_logprobs")
    return k


def continuation_result(request: Request, scores: ScoreBuffer, context_tokens: int) -> Result:
    return Result(
        id=request.id,
        adapter=request.adapter or None,
        text="",
        prompt_tokens=context_tokens,
        finish_reason="score",
        extra=request.extra,
        logprob=float(scores.logprobs.sum()),
        token_logprobs=scores.logprobs.tolist(),
        is_greedy=bool(scores.greedy.all()),
        continuation_tokens=int(scores.logprobs.size),
        correct=_correct(request, [scores]),
    )


def choices_result(group: ChoiceGroup, context_tokens: int) -> Result:
    scores = [group.done[i] for i in range(group.count)]
    sums = [float(s.logprobs.sum()) for s in scores]
    means = [total / s.logprobs.size for total, s in zip(sums, scores, strict=True)]
    return Result(
        id=group.request.id,
        adapter=group.request.adapter or None,
        text="",
        prompt_tokens=context_tokens,
        finish_reason="score",
        extra=group.request.extra,
        choice_logprobs=sums,
        choice_tokens=[int(s.logprobs.size) for s in scores],
        choice_greedy=[bool(s.greedy.all()) for s in scores],
        best_choice=int(np.argmax(sums)),
        best_choice_norm=int(np.argmax(means)),
        correct=_correct(group.request, scores),
    )


def _correct(request: Request, scores: list[ScoreBuffer]) -> bool | None:
    index = answer_index(request, len(scores))
    if index is None:
        return None
    if len(scores) == 1:  # a continuation with an answer: whether it is the greedy one
        return bool(scores[0].greedy.all())
    sums = [s.logprobs.sum() for s in scores]
    return int(np.argmax(sums)) == index


def _context_text(request: Request, tokenizer) -> str | None:
    """The context as text (the chat template applied to messages); None for given ids."""
    if request.prompt is not None:
        return request.prompt
    if request.messages is not None:
        return tokenizer.apply_chat_template(
            request.messages, add_generation_prompt=True, tokenize=False
        )
    return None


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=special)["input_ids"]]


def token_logprobs(tokenizer, entries: list[tuple], count: int) -> list[dict]:
    """A generated row's ``logprobs`` column from its per-token entries (token id, its
    log-probability, the top ids, their log-probabilities), the first ``count`` of them."""

    def text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else ""

    out = []
    for token, value, top_ids, top_values in entries[:count]:
        top = [
            {"token_id": int(t), "text": text(int(t)), "logprob": float(v)}
            for t, v in zip(top_ids, top_values, strict=True)
        ]
        out.append(
            {"token_id": int(token), "text": text(token), "logprob": float(value), "top": top}
        )
    return out
