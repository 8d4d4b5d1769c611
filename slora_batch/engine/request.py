"""What goes into the engine (``Request``) and what comes out (``Result``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "error"]


@dataclass
class Request:
    """One row to generate.

    Exactly one of ``prompt`` (raw text, tokenized with the tokenizer's BOS rule), ``messages``
    (chat turns, the model's chat template applied) or ``prompt_token_ids`` is given. ``adapter``
    None or "" means the base model. Sampling fields left None take the engine's defaults.
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


SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


@dataclass
class Result:
    """One finished row. ``finish_reason`` is "stop", "length" or "error" (then ``error`` says why)."""

    id: Any
    adapter: str | None
    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason = "stop"
    error: str | None = None
    extra: dict[str, Any] | None = None  # the request's ``extra``, unchanged

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
