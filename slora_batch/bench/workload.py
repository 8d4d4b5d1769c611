"""The bench's requests (benchmarks/README.md): the standard workload, the scoring rows and the
shared-prefix rows, each fixed by the seed, and the adapter every row names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slora_batch.bench.model import build_model as build_model  # benchmarks/profile_engine.py
from slora_batch.engine.requests.request import Request
from slora_batch.jobs.ordering import sort_key


def adapter_name(i: int) -> str:
    return f"a{i:04d}"


def adapter_sources(
    n: int, rank_dirs: dict[int, Path], dora_dirs: dict[int, Path] | None = None
) -> dict[str, Path]:
    """n adapter ids over the shared weight sets, ranks cycling in ``rank_dirs``' order: id i ->
    the directory of the (i % len(rank_dirs))-th rank (model.RANKS: 8, 16, 32, 64, 8, ...).
    With ``dora_dirs`` (rank -> DoRA directory; ``slora-dora``) the ids ``is_dora`` names take
    their rank's DoRA directory instead."""
    ranks = list(rank_dirs)
    dora = dora_dirs or {}

    def source(i: int) -> Path:
        rank = ranks[i % len(ranks)]
        return dora[rank] if rank in dora and is_dora(i) else rank_dirs[rank]

    return {adapter_name(i): source(i) for i in range(n)}


def is_dora(i: int) -> bool:
    """Whether adapter id i is a DoRA one in ``slora-dora``: one id in four, in runs of four
    ids (those whose i // 4 is a multiple of 4), so every rank of a 4-rank cycle has DoRA ids.
    Example: ids 0-3 (ranks 8, 16, 32, 64) and 16-19 are DoRA, 4-15 and 20-31 not."""
    return (i // 4) % 4 == 0


def drawn_indices(draws: np.ndarray, n: int) -> list[int]:
    """Row i's adapter index among n >= 1: ``int(draws[i] * n)``."""
    return [min(int(d * n), n - 1) for d in draws]


def drawn_adapters(draws: np.ndarray, n: int) -> list[str | None]:
    """Row i's adapter among n: ``int(draws[i] * n)`` (None for every row when n == 0)."""
    if n == 0:
        return [None] * len(draws)
    return [adapter_name(i) for i in drawn_indices(draws, n)]


@dataclass
class Workload:
    """The requests, fixed by the seed. Adapter counts only change which adapter a request names:
    request i uses adapter ``int(draw[i] * n)`` with draw ~ numpy power(alpha)."""

    prompts: list[list[int]]
    output_lens: list[int]
    draws: np.ndarray  # [requests] in [0, 1)

    @classmethod
    def generate(cls, config, vocab_size: int, count: int | None = None) -> Workload:
        """``count`` requests (None: ``config.requests``) of the configured shapes."""
        rng = np.random.default_rng(config.seed)
        count = config.requests if count is None else count
        input_lens = rng.integers(config.min_input, config.max_input + 1, size=count)
        output_lens = rng.integers(config.min_output, config.max_output + 1, size=count)
        draws = rng.power(0.1 if config.skewed else 1.0, size=count)
        # ids 0-2 are pad, BOS and EOS; prompts draw from the rest of the vocabulary
        prompts = [rng.integers(3, vocab_size, size=int(n)).tolist() for n in input_lens]
        return cls(prompts=prompts, output_lens=[int(n) for n in output_lens], draws=draws)

    def adapters(self, n: int) -> list[str | None]:
        """The adapter of every request when n adapters exist (None for all when n == 0)."""
        return drawn_adapters(self.draws, n)

    def requests(self, n: int, count: int | None = None) -> list[Request]:
        count = len(self.prompts) if count is None else min(count, len(self.prompts))
        names = self.adapters(n)
        return [
            Request(
                id=i,
                adapter=names[i],
                prompt_token_ids=self.prompts[i],
                max_new_tokens=self.output_lens[i],
                ignore_eos=True,
                temperature=0.0,
            )
            for i in range(count)
        ]


@dataclass
class ScoreWorkload:
    """The scoring rows (``score`` and ``peft-score``), fixed by the seed: row i is a context of
    U[score_min_context, score_max_context] random ids and ``score_choices`` choices of
    U[score_min_choice, score_max_choice] random ids each, and names its adapter by the same
    popularity rule as ``Workload`` (``drawn_adapters``)."""

    contexts: list[list[int]]
    choices: list[list[list[int]]]  # [rows][score_choices] token ids
    draws: np.ndarray  # [rows] in [0, 1)

    @classmethod
    def generate(cls, config, vocab_size: int) -> ScoreWorkload:
        rng = np.random.default_rng(config.seed)
        count, k = config.score_rows, config.score_choices
        context_lens = rng.integers(
            config.score_min_context, config.score_max_context + 1, size=count
        )
        choice_lens = rng.integers(
            config.score_min_choice, config.score_max_choice + 1, size=(count, k)
        )
        draws = rng.power(0.1 if config.skewed else 1.0, size=count)
        # ids 0-2 are pad, BOS and EOS, as in Workload
        contexts = [rng.integers(3, vocab_size, size=int(n)).tolist() for n in context_lens]
        choices = [
            [rng.integers(3, vocab_size, size=int(m)).tolist() for m in lens]
            for lens in choice_lens
        ]
        return cls(contexts=contexts, choices=choices, draws=draws)

    def adapters(self, n: int) -> list[str | None]:
        return drawn_adapters(self.draws, n)

    def tokens(self, row: int) -> int:
        """Tokens the row computes: its context once per choice, and every choice but its last
        token, never fed (``score_run.computed_tokens``; both scoring systems count these)."""
        choices = self.choices[row]
        return len(choices) * (len(self.contexts[row]) - 1) + sum(map(len, choices))

    def requests(self, n: int, count: int | None = None) -> list[Request]:
        count = len(self.contexts) if count is None else min(count, len(self.contexts))
        names = self.adapters(n)
        return [
            Request(
                id=i,
                adapter=names[i],
                prompt_token_ids=self.contexts[i],
                choices_token_ids=self.choices[i],
            )
            for i in range(count)
        ]


@dataclass
class PrefixWorkload:
    """The shared-prefix rows (``prefix``, ``prefix-off``), fixed by the seed: one prefix of
    ``prefix_tokens`` random ids per adapter, and row i, of adapter ``int(draw[i] * n)`` (the
    popularity rule of ``Workload``), is its adapter's prefix then a suffix of its own of
    U[prefix_min_suffix, prefix_max_suffix] random ids, and asks for ``prefix_output`` tokens.
    Prefix j is the same for every adapter count (drawn row-major after everything else)."""

    prefixes: list[list[int]]  # [max adapters][prefix_tokens]
    suffixes: list[list[int]]  # [rows][its length]
    draws: np.ndarray  # [rows] in [0, 1)
    output: int

    @classmethod
    def generate(cls, config, vocab_size: int) -> PrefixWorkload:
        rng = np.random.default_rng(config.seed)
        count = config.prefix_rows
        suffix_lens = rng.integers(
            config.prefix_min_suffix, config.prefix_max_suffix + 1, size=count
        )
        draws = rng.power(0.1 if config.skewed else 1.0, size=count)
        # ids 0-2 are pad, BOS and EOS, as in Workload
        suffixes = [rng.integers(3, vocab_size, size=int(n)).tolist() for n in suffix_lens]
        shape = (max(config.adapters), config.prefix_tokens)
        prefixes = rng.integers(3, vocab_size, size=shape).tolist()
        return cls(prefixes=prefixes, suffixes=suffixes, draws=draws, output=config.prefix_output)

    def requests(self, n: int) -> list[Request]:
        """The rows at n adapters (1 <= n <= len(prefixes)), in generated order."""
        return [
            Request(
                id=i,
                adapter=adapter_name(j),
                prompt_token_ids=self.prefixes[j] + self.suffixes[i],
                max_new_tokens=self.output,
                ignore_eos=True,
                temperature=0.0,
            )
            for i, j in enumerate(drawn_indices(self.draws, n))
        ]


def group_by_adapter(requests: list[Request]) -> list[Request]:
    """The requests stably sorted by adapter (base-model rows first), arrival order within an
    adapter: the job's sort without its second key, prompt length, so that a run cut at its time
    limit still sees the workload's mix of lengths. Example: adapters [b, a, None, b] -> [None, a,
    b, b], the two b rows in their order."""
    return sorted(requests, key=lambda r: sort_key(r)[:3])  # (kind, has adapter, adapter)
