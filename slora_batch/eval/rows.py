"""One lm-eval request as engine rows, and the engine's results back as lm-eval's answers.

A request's rows are keyed by a hash of (request type, arguments): the same request of two
tasks is one row, and the key is the row's ``id`` in an eval job's requests file, stable from
run to run (resume). A rolling request is one scored row per window (``<key>/<window>``).
Answers: loglikelihood ``(logprob, is_greedy)``, loglikelihood_rolling the sum over windows,
generate_until the text (``Encoder.answer``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from slora_batch.eval.encoding import Encoder

REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


class EvalRowError(RuntimeError):
    """An engine row of an lm-eval request failed: no metric can be computed from it."""


def request_key(request_type: str, args: tuple) -> str:
    text = json.dumps([request_type, list(args)], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:24]


def request_rows(encoder: Encoder, request_type: str, args: tuple) -> list[dict[str, Any]]:
    """The engine rows (``Request`` fields, ``adapter`` left out) that answer one request."""
    key = request_key(request_type, args)
    if request_type == "loglikelihood":
        ctx, cont = encoder.pair(*args)
        return [{"id": key, "prompt_token_ids": ctx, "continuation_token_ids": cont}]
    if request_type == "loglikelihood_rolling":
        return [
            {"id": f"{key}/{k}", "prompt_token_ids": ctx, "continuation_token_ids": cont}
            for k, (ctx, cont) in enumerate(encoder.rolling(args[0]))
        ]
    if request_type == "generate_until":
        fields, _ = encoder.generation(args[0], args[1])
        return [{"id": key, **fields}]
    raise ValueError(f"request type {request_type!r} is not one of {', '.join(REQUEST_TYPES)}")


def answer(
    encoder: Encoder,
    request_type: str,
    args: tuple,
    results: Mapping[str, Mapping[str, Any]],
    adapter: str | None = None,
) -> Any:
    """lm-eval's answer to one request from its rows' results ({row id: {"logprob",
    "is_greedy", "token_ids", "error"}}); a failed or missing row raises ``EvalRowError``."""
    key = request_key(request_type, args)

    def row(row_id: str) -> Mapping[str, Any]:
        found = results.get(row_id)
        if found is None or found.get("error"):
            why = "no result" if found is None else found["error"]
            raise EvalRowError(
                f"{request_type} request {str(args)[:120]!r} (row {row_id}, adapter "
                f"{adapter!r}): {why}"
            )
        return found

    if request_type == "loglikelihood":
        found = row(key)
        return float(found["logprob"]), bool(found["is_greedy"])
    if request_type == "loglikelihood_rolling":
        windows = len(encoder.rolling(args[0]))
        return float(sum(row(f"{key}/{k}")["logprob"] for k in range(windows)))
    _, until = encoder.generation(args[0], args[1])
    return encoder.answer(list(row(key)["token_ids"]), until)
