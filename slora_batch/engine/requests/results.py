"""A finished sequence's ``Result``: its text (cut at a stop string), ids, counts, logprobs; or
a scored row's scores."""

from __future__ import annotations

from slora_batch.engine.requests.request import Result
from slora_batch.engine.requests.scoring import choices_result, continuation_result, token_logprobs
from slora_batch.engine.requests.sequence import Sequence


def sequence_result(seq: Sequence, tokenizer) -> Result | None:
    """The row's result, or None for a choice of a row whose other choices are still running."""
    if seq.group is not None:
        complete = seq.group.add(seq.choice, seq.scores)
        return choices_result(seq.group, seq.context_tokens) if complete else None
    if seq.scores is not None:
        return continuation_result(seq.request, seq.scores, seq.context_tokens)
    if seq.detok is not None:  # fed token by token for its stop strings: cut at the stop
        text = seq.detok.text
    elif tokenizer is not None:
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    else:
        text = ""
    return Result(
        id=seq.request.id,
        adapter=seq.adapter,
        text=text,
        token_ids=list(seq.output_ids),
        prompt_tokens=len(seq.prompt_ids),
        completion_tokens=len(seq.output_ids),
        finish_reason=seq.finish_reason,
        extra=seq.request.extra,
        sample_index=seq.sample_index,
        logprobs=token_logprobs(tokenizer, seq.logprob_entries, len(seq.output_ids))
        if seq.logprobs is not None
        else None,
    )
