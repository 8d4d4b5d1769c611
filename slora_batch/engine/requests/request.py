"""What goes into the engine (``Request``) and what comes out (``Result``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "error", "score"]


@dataclass
class Request:
    """One row to generate, or to score.

    Exactly one of ``prompt`` (raw text, tokenized with the tokenizer's BOS rule), ``messages``
    (chat turns, the model's chat template applied) or ``prompt_token_ids`` is given. ``adapter``
    None or "" means the base model. Sampling fields left None take the engine's defaults.

    A row with ``continuation`` (or ``choices``, a list) is scored instead of generated: the
    log-probability of each continuation after the prompt, nothing sampled. Pre-tokenized rows
    give ``continuation_token_ids`` / ``choices_token_ids`` instead. ``answer`` (a choice's index
    or its text) adds ``Result.correct``. ``logprobs`` (0-20) on a generated row returns, per
    generated token, its log-probability and the ``logprobs`` most likely alternatives.
    ``response_format`` decodes the row under a grammar (JSON schema, regex, choice, EBNF).
    """

    id: Any
    adapter: str | None = None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool | None = None
    extra: dict[str, Any] | None = None  # carried unchanged to ``Result.extra`` (kept columns)
    source: str | None = None  # where the row came from ("in.jsonl line 7"), for error messages
    continuation: str | None = None
    choices: list[str] | None = None
    continuation_token_ids: list[int] | None = None
    choices_token_ids: list[list[int]] | None = None
    answer: int | str | None = None
    logprobs: int | None = None
    n: int | None = None  # samples of a generated row (SamplingConfig.n when None)
    # Which of the n samples to make (None: all): a resumed job asks for the missing ones.
    sample_indices: list[int] | None = None
    # Structured output (``requests/formats.py``): {"type": "json_schema", "json_schema":
    # {"name", "schema"}}, json_object, regex, choice, grammar; an object or its JSON text.
    response_format: dict[str, Any] | str | None = None

    @property
    def scored(self) -> bool:
        """Whether the row is scored (it names a continuation or choices) rather than generated."""
        return any(
            getattr(self, name) is not None
            for name in ("continuation", "choices", "continuation_token_ids", "choices_token_ids")
        )


SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "n",
    "response_format",
)
SCORING_FIELDS = (
    "continuation",
    "choices",
    "continuation_token_ids",
    "choices_token_ids",
    "answer",
)


@dataclass
class Result:
    """One finished row. ``finish_reason`` is "stop", "length", "score" (a scored row) or
    "error" (then ``error`` says why).

    A scored row with ``continuation`` sets ``logprob`` (the sum over its tokens),
    ``token_logprobs``, ``is_greedy`` (every token was the most likely one) and
    ``continuation_tokens`` (how many); one with ``choices`` sets the ``choice_*`` lists, one
    entry per choice, ``best_choice`` (highest sum) and ``best_choice_norm`` (highest mean per
    token); with an ``answer``, ``correct``. A generated row asked for ``logprobs`` gets, per
    generated token, ``{"token_id", "text", "logprob", "top": [{"token_id", "text",
    "logprob"}, ...]}``.
    """

    id: Any
    adapter: str | None
    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason = "stop"
    error: str | None = None
    extra: dict[str, Any] | None = None  # the request's ``extra``, unchanged
    logprob: float | None = None
    token_logprobs: list[float] | None = None
    is_greedy: bool | None = None
    continuation_tokens: int | None = None
    choice_logprobs: list[float] | None = None
    choice_tokens: list[int] | None = None
    choice_greedy: list[bool] | None = None
    best_choice: int | None = None
    best_choice_norm: int | None = None
    correct: bool | None = None
    logprobs: list[dict[str, Any]] | None = None
    sample_index: int = 0  # which of the row's n samples this is

    @classmethod
    def failed(cls, request: Request, message: str, prompt_tokens: int = 0) -> Result:
        adapter = request.adapter or None
        where = f"{request.source}: " if request.source else ""
        return cls(
            id=request.id,
            adapter=adapter,
            text="",
            prompt_tokens=prompt_tokens,
            finish_reason="error",
            error=f"{where}row {request.id!r} (adapter {adapter!r}): {message}",
            extra=request.extra,
        )
