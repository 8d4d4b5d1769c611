"""A request becomes a ``Sequence`` the scheduler can run, or an error ``Result`` that says why.

Checks, in order: the adapter (broken, or unknown with the nearest known names), the sampling
overrides, the response format's shape and logprobs, tokenization (prompt, chat template, given ids; a scored row's
continuations and answer), the prompt (and each continuation) against the context, and the
pages the row needs at the least against the pool. A bad request never raises.
"""

from __future__ import annotations

from dataclasses import replace

from slora_batch.engine.adapters.store import AdapterError, AdapterStore
from slora_batch.engine.config import ConfigError, SamplingConfig
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.requests.formats import Format, parse_format
from slora_batch.engine.requests.grammar import JSON_KINDS, GrammarService, GrammarState
from slora_batch.engine.requests.request import SAMPLING_FIELDS, Request, Result
from slora_batch.engine.requests.sampling import noise_key
from slora_batch.engine.requests.scoring import (
    ChoiceGroup,
    ScoreBuffer,
    answer_index,
    check_logprobs,
    scored_ids,
)
from slora_batch.engine.requests.sequence import Sequence
from slora_batch.engine.requests.tokens import Detokenizer, tokenize
from slora_batch.engine.scheduling.scheduler import Scheduler


class RequestPreparer:
    """Turns requests into sequences for one engine (its store, tokenizer, limits)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: AdapterStore,
        broken: dict[str, AdapterError],
        tokenizer,
        sampling: SamplingConfig,
        max_model_len: int,
        scheduler: Scheduler,
        grammars: GrammarService,
    ) -> None:
        self.spec, self.store, self.broken = spec, store, broken
        self.grammars = grammars
        self.tokenizer, self.sampling = tokenizer, sampling
        self.max_model_len, self.scheduler = max_model_len, scheduler
        self.arrivals = 0

    def __call__(self, request: Request) -> Sequence | Result:
        problem = self._adapter_problem(request.adapter or None)
        if problem is not None:
            return Result.failed(request, problem)
        try:
            params = self.sampling_for(request)
            scored = request.scored  # a property over four fields: once
            fmt = None if scored else parse_format(params.response_format)
            logprobs = check_logprobs(request)
            prompt_ids = tokenize(request, self.tokenizer, self.spec.vocab_size, self.spec.path)
            if prompt_ids and scored:
                vocab = self.spec.vocab_size
                prompt_ids, continuations = scored_ids(request, prompt_ids, self.tokenizer, vocab)
                answer_index(request, len(continuations))
        except (ConfigError, ValueError, TypeError) as exc:
            return Result.failed(request, str(exc))
        if not prompt_ids:
            return Result.failed(request, "empty prompt")
        if scored:
            return self._scored(request, prompt_ids, continuations)
        return self._generated(request, params, fmt, logprobs, prompt_ids)

    def _adapter_problem(self, adapter: str | None) -> str | None:
        """Why the row's adapter cannot be used (broken, or unknown with the nearest known
        names), or None when it can (or the row has none)."""
        if adapter is None:
            return None
        if adapter in self.broken:
            return f"adapter cannot be used: {self.broken[adapter]}"
        if adapter not in self.store:
            near = self.store.nearest(adapter)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            return f"unknown adapter {adapter!r} ({len(self.store.names)} adapters known{hint})"
        return None

    def _generated(
        self, request: Request, params: SamplingConfig, fmt, logprobs, prompt_ids: list[int]
    ) -> Sequence | Result:
        """One sequence per sample the row asks for (the others follow the first, which
        computes the prompt for the prefix cache), each with its grammar, or an error result."""
        n = len(prompt_ids)
        indices = request.sample_indices if request.sample_indices is not None else range(params.n)
        bad = [
            i
            for i in indices
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < params.n
        ]
        if bad or not indices:
            return Result.failed(
                request, f"sample_indices {list(indices)} are not in 0..{params.n - 1}"
            )
        if n >= self.max_model_len:
            return Result.failed(
                request,
                f"prompt of {n} tokens does not fit the context of {self.max_model_len} tokens",
                prompt_tokens=n,
            )
        seqs = [self._sample(request, params, prompt_ids, logprobs, i) for i in indices]
        problem = self.scheduler.never_fits(seqs[0])
        if problem:
            return Result.failed(request, problem, prompt_tokens=n)
        if fmt is not None:
            problem = self._attach_grammar(fmt, seqs)
            if problem:
                return Result.failed(request, problem, prompt_tokens=n)
        seqs[0].followers = seqs[1:]  # queued when the first one's prompt is computed
        seqs[0].context_tokens = n
        return seqs[0]

    def _attach_grammar(self, fmt: Format, seqs: list[Sequence]) -> str | None:
        """A matcher of the format's grammar for each sample (the grammar compiled off the loop,
        once per format), or why the grammar cannot be built."""
        try:
            future = self.grammars.submit(fmt)
        except ValueError as exc:  # no tokenizer to build the grammar's vocabulary from
            return str(exc)
        only = self.grammars.json_allowed if fmt.kind in JSON_KINDS else None
        for seq in seqs:
            seq.grammar = GrammarState(future, only)
        return None

    def _sample(self, request, params, prompt_ids: list[int], logprobs, index: int) -> Sequence:
        """The sequence of one sample of a generated row."""
        n = len(prompt_ids)
        self.arrivals += 1
        stop = list(params.stop)
        # Sample 0's noise is the row's as it was before n existed; sample k's its own.
        key = noise_key(params.seed, request.id, index)
        return Sequence(
            request=request,
            order=self.arrivals,
            adapter=request.adapter or None,
            prompt_ids=prompt_ids,
            max_new_tokens=min(params.max_new_tokens, self.max_model_len - n),
            temperature=float(params.temperature),
            top_k=params.top_k,
            top_p=float(params.top_p),
            key=key,
            stop=stop,
            ignore_eos=params.ignore_eos,
            detok=Detokenizer(self.tokenizer, stop)
            if self.tokenizer is not None and stop
            else None,
            logprobs=logprobs,
            sample_index=index,
        )

    def _scored(
        self, request: Request, context: list[int], continuations: list[list[int]]
    ) -> Sequence | Result:
        """One prefill-only sequence per continuation (a row with choices: one per choice, in
        a group that joins their scores; the others follow the first, which computes the
        context for the prefix cache), or an error result."""
        if request.n not in (None, 1) or request.sample_indices:
            # the engine's (or job's) n is for generated rows: only the row's own
            asks = f"n={request.n}" if request.n not in (None, 1) else "sample_indices"
            return Result.failed(
                request, f"n is for generated rows, not scored ones (the row asks {asks})"
            )
        n = len(context)
        choices = request.choices is not None or request.choices_token_ids is not None
        group = ChoiceGroup(request, len(continuations)) if choices else None
        seqs = []
        for index, ids in enumerate(continuations):
            what = f"choice {index}" if choices else "continuation"
            if n + len(ids) - 1 > self.max_model_len:  # the last token is never fed
                return Result.failed(
                    request,
                    f"context of {n} tokens + {what} of {len(ids)} tokens does not fit the "
                    f"context of {self.max_model_len} tokens (a scored row is fed all its "
                    f"tokens but the last: at most {self.max_model_len + 1} in all)",
                    prompt_tokens=n,
                )
            self.arrivals += 1
            seq = Sequence(
                request=request,
                order=self.arrivals,
                adapter=request.adapter or None,
                prompt_ids=context + ids[:-1],
                max_new_tokens=0,
                temperature=0.0,
                top_k=0,
                top_p=1.0,
                key=0,
                stop=[],
                ignore_eos=True,
                scores=ScoreBuffer.empty(n, ids),
                group=group,
                choice=index,
                context_tokens=n,
            )
            problem = self.scheduler.never_fits(seq)
            if problem:
                return Result.failed(request, f"{what}: {problem}", prompt_tokens=n)
            seqs.append(seq)
        seqs[0].followers = seqs[1:]  # queued once the first has computed the context
        return seqs[0]

    def sampling_for(self, request: Request) -> SamplingConfig:
        """The engine's sampling with the request's own fields over it."""
        own = {k: getattr(request, k) for k in SAMPLING_FIELDS if getattr(request, k) is not None}
        return replace(self.sampling, **own)  # a shallow copy: asdict's deep one cost more
