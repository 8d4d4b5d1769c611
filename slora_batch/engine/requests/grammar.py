"""Structured output: grammars compiled off the step loop, rows waiting for theirs, and each
sample's matcher.

``GrammarService`` compiles each distinct format (``formats.Format.key``) once, in a thread
pool, with xgrammar; a row whose grammar is not ready waits here (``park``), outside the
scheduler, so running rows never stall on a new schema. ``GrammarState`` is one sample's
matcher: it accepts the row's tokens as they become known, at most once each (a preempted row
recomputes its KV, never its grammar), and fills the row's bitmask for the next draw.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slora_batch.engine.requests.formats import Format
from slora_batch.engine.requests.request import Result

log = logging.getLogger(__name__)

# xgrammar's messages start with "[hh:mm:ss] /path/to/file.cc:123: ": the reason follows.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


JSON_KINDS = ("json_object", "json_schema")  # compact JSON: never a raw control character
CONTROL_BYTES = bytes(range(0x20))


def without_control_bytes(decoded_vocab: list[bytes], vocab_size: int):
    """An xgrammar bitmask row (int32 [ceil(vocab_size / 32)], bit j of word i for token
    32 i + j) allowing every token whose bytes hold no control character (0x00-0x1f).

    JSON allows none outside escapes, and compact JSON (no whitespace but single spaces) none
    between values either; xgrammar 0.2.9's string with ``maxLength`` accepts them raw (a row
    once ended with 0x14 inside a string, which ``json.loads`` rejects). JSON rows AND this in.
    """
    import numpy as np
    import torch

    words = (vocab_size + 31) // 32
    allowed = np.zeros(words * 32, dtype=np.uint64)
    for token, piece in enumerate(decoded_vocab[:vocab_size]):
        allowed[token] = len(piece.translate(None, CONTROL_BYTES)) == len(piece)
    packed = (allowed.reshape(words, 32) << np.arange(32, dtype=np.uint64)).sum(1)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


class GrammarError(ValueError):
    """The compiler rejected a format (its message, without xgrammar's source location)."""


def tokenizer_info(tokenizer, spec, given=None):
    """xgrammar's view of the model's Hugging Face tokenizer over the model's logits width
    (``spec.vocab_size``, often padded past the tokenizer): ids the tokenizer does not cover
    are never allowed; the model's EOS ids end a grammar. ``given`` (a TokenizerInfo) wins."""
    if given is not None:
        return given
    if tokenizer is None:
        raise ValueError(f"response_format needs a tokenizer; the model at {spec.path} has none")
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=spec.vocab_size, stop_token_ids=list(spec.eos_token_ids)
    )


def _compile(compiler, fmt: Format):
    try:
        if fmt.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if fmt.kind == "json_schema":
            return compiler.compile_json_schema(fmt.source, any_whitespace=False)
        if fmt.kind == "regex":
            return compiler.compile_regex(fmt.source)
        return compiler.compile_grammar(fmt.source)
    except RuntimeError as exc:
        reason = _LOCATION.sub("", str(exc)).strip()
        raise GrammarError(f"{fmt.kind} does not compile: {reason}") from None


class GrammarService:
    """One tokenizer's grammar compiler, its cache by format key, and the rows waiting for it.

    ``make_info()`` returns an ``xgrammar.TokenizerInfo`` whose vocab_size is the model's logits
    width, or raises ValueError (no tokenizer); it runs at the first format, so that an engine
    whose rows have none never imports xgrammar."""

    def __init__(self, make_info: Callable[[], Any], threads: int = 2) -> None:
        self.make_info, self.threads = make_info, threads
        self.compiler = None  # built with the first format
        self.vocab_size = 0
        self.json_allowed = None  # without_control_bytes over the vocabulary, for JSON rows
        self.pool: cf.ThreadPoolExecutor | None = None
        self.compiled: dict[str, cf.Future] = {}
        self.parked: list = []  # sequences whose grammar is compiling, in arrival order

    @property
    def active(self) -> bool:
        """Whether any format was asked for (only then do steps look for constrained rows)."""
        return self.compiler is not None

    def submit(self, fmt: Format) -> cf.Future:
        """The format's compiled grammar (a future): compiled once per distinct key."""
        if self.compiler is None:
            import xgrammar as xgr

            info = self.make_info()
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self.vocab_size = info.vocab_size
            self.json_allowed = without_control_bytes(info.decoded_vocab, info.vocab_size)
            self.pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="grammar")
        future = self.compiled.get(fmt.key)
        if future is None:
            future = self.compiled[fmt.key] = self.pool.submit(_compile, self.compiler, fmt)
        return future

    def compile_now(self, fmt: Format):
        """The compiled grammar, waiting for it; raises GrammarError when it does not compile."""
        return self.submit(fmt).result()

    def park(self, seq) -> None:
        """Holds a sequence until its grammar is compiled (``take``)."""
        self.parked.append(seq)

    def take(self) -> tuple[list, list[Result]]:
        """The parked sequences whose grammar is ready, in arrival order, and the error results
        of those whose format did not compile."""
        ready, failed, still = [], [], []
        for seq in self.parked:
            future = seq.grammar.future
            if not future.done():
                still.append(seq)
            elif future.exception() is not None:
                n = len(seq.prompt_ids)
                failed.append(Result.failed(seq.request, str(future.exception()), n))
            else:
                ready.append(seq)
        self.parked = still
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Blocks until a parked sequence's grammar is done (or ``timeout`` seconds)."""
        if self.parked:
            cf.wait([s.grammar.future for s in self.parked], timeout, cf.FIRST_COMPLETED)

    def close(self) -> None:
        self.parked = []
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class GrammarState:
    """One sample's matcher over its format's compiled grammar (``future``), created when the
    grammar is ready. ``accepted``: how many of the sample's output tokens it has taken;
    ``only``: a bitmask row ANDed into every mask (JSON rows: ``without_control_bytes``)."""

    future: cf.Future
    only: Any = None
    matcher: Any = None
    accepted: int = 0

    def _match(self):
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.future.result())
        return self.matcher

    def accept(self, token_ids, known: int, row) -> bool:
        """Takes ``token_ids[self.accepted:known]``; returns whether the grammar has ended (a stop
        token taken). A token the grammar rejects is a bug in the mask: it raises, naming it."""
        matcher = self._match()
        while self.accepted < known:
            token = token_ids[self.accepted]
            if matcher.is_terminated():
                return True
            if not matcher.accept_token(token):
                raise RuntimeError(
                    f"row {row!r}: token {token} at output position {self.accepted} is outside "
                    "its grammar (the mask was not applied)"
                )
            self.accepted += 1
        return matcher.is_terminated()

    def fill(self, bitmask, index: int) -> bool:
        """Writes the tokens allowed next into ``bitmask[index]``; False (row left as it was)
        when the grammar has ended, so the draw is one no one reads."""
        matcher = self._match()
        if matcher.is_terminated():
            return False
        matcher.fill_next_token_bitmask(bitmask, index)
        if self.only is not None:
            bitmask[index] &= self.only
        return True
