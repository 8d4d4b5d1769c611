"""The ``peft-score`` system: transformers + PEFT scoring the rows of ``score`` the way evaluation
harnesses do, in right-padded batches per adapter.

The n adapters (n <= 100) are loaded into one ``PeftModel`` (``peft_run.load_peft``). The first
``peft_score_rows`` rows of the scoring workload are grouped by adapter, sorted longest first
within an adapter (the harnesses' order: less padding) and cut into batches of
``peft_score_batch`` rows that never mix adapters (``set_adapter`` per batch). A batch is its
rows' choices as context + choice sequences (8 rows of 4 choices: 32 sequences), right-padded,
with an attention mask; one forward, then a log-softmax only at the positions that predict a
choice token, summed per choice (``choice_sums``).

The batches run in a seeded random order, so that a run cut at ``peft_max_seconds`` sees the
workload's mix of lengths and not its longest rows first; no batch starts after the limit, and
a started one runs to its end. Figures as ``score``'s: ``rows_per_s`` and
``scored_tokens_per_s`` (padding not counted; ``padding_share`` says how much there was).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from slora_batch.bench.peft_run import PAD_ID, load_peft
from slora_batch.bench.roofline import Work
from slora_batch.bench.row_fields import figures
from slora_batch.bench.timed_run import COUNTERS, sync
from slora_batch.bench.workload import ScoreWorkload, adapter_sources

log = logging.getLogger(__name__)


def run_peft_score(ctx, n: int) -> dict:
    cfg, model, workload = ctx.config, ctx.model, ctx.score_workload
    device = model.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    batches = score_batches(workload, n, cfg.peft_score_rows, cfg.peft_score_batch, cfg.seed)
    rows = sum(len(ids) for _, ids in batches)
    peft_model = load_peft(model.hf_model, adapter_sources(n, ctx.rank_dirs))
    try:
        adapter, ids = batches[0]  # warm-up, not counted: the first batch once
        peft_model.set_adapter(adapter)
        choice_sums(peft_model, _rows(workload, ids), device)
        sync(device)
        setup_s = time.perf_counter() - start
        work, finished, done, padded, cut = Work(), 0, 0, 0, False
        start = time.perf_counter()
        deadline = start + cfg.peft_max_seconds if cfg.peft_max_seconds else None
        for adapter, ids in batches:
            if deadline is not None and time.perf_counter() >= deadline:
                cut = True
                break
            peft_model.set_adapter(adapter)
            batch = _rows(workload, ids)
            choice_sums(peft_model, batch, device)
            done += 1
            finished += len(ids)
            padded += sum(len(choices) for _, choices in batch) * _width(batch)
            for i in ids:
                work.add(workload.tokens(i), 0)
        sync(device)
        wall_s = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else math.nan
    finally:
        peft_model.unload()  # gives the base model its own modules back for the next runs
        del peft_model
    log.info(
        "peft-score: %d adapters, %d of %d batches of up to %d rows",
        n,
        done,
        len(batches),
        cfg.peft_score_batch,
    )
    row = dict(
        system="peft-score",
        adapters=n,
        requests=rows,
        fed=finished,
        finished=finished,
        error_rows=0,
        length_mismatches=0,
        truncated=cut,
        setup_s=setup_s,
        peak_mem_gib=peak,
    )
    row.update(figures(ctx, work, finished, wall_s))
    row.update(
        output_tokens_per_s=math.nan,
        rows_per_s=row["requests_per_s"],
        scored_tokens=work.prompt_tokens,
        scored_tokens_per_s=work.prompt_tokens / wall_s,
        padding_share=1 - work.prompt_tokens / padded if padded else math.nan,
    )
    row.update(dict.fromkeys(COUNTERS, math.nan))  # engine counters: none of them apply
    row.update(
        steps=float(done),
        adapter_loads=float(n),
        host_share=math.nan,
        decode_host_share=math.nan,
        decode_batch=math.nan,
        step_tokens=work.prompt_tokens / done if done else math.nan,
    )
    return row


def score_batches(
    workload: ScoreWorkload, n: int, rows: int, batch: int, seed: int
) -> list[tuple[str, list[int]]]:
    """(adapter, row ids) of every batch over the first ``rows`` rows at n adapters: an adapter's
    rows longest context first, cut into batches of up to ``batch``; the batches in a seeded
    random order. Example: rows 0-2 of adapter b (contexts 5, 9, 7) and row 3 of a, batch 2 ->
    [(a, [3]), (b, [1, 2]), (b, [0])] in some order."""
    names = workload.adapters(n)[:rows]
    by_adapter: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        by_adapter.setdefault(name, []).append(i)
    batches = []
    for name in sorted(by_adapter):
        ids = sorted(by_adapter[name], key=lambda i: -len(workload.contexts[i]))
        batches += [(name, ids[k : k + batch]) for k in range(0, len(ids), batch)]
    order = np.random.default_rng(seed).permutation(len(batches))
    return [batches[i] for i in order]


def choice_sums(
    model, batch: list[tuple[list[int], list[list[int]]]], device: torch.device
) -> list[list[float]]:
    """Per row of ``batch`` (context ids, its choices' ids), the log-probability sum of each
    choice after the context, from one forward of the right-padded context + choice sequences.

    Semantics: seq s = context + choice, its choice starting at c = len(context);
        sums[row][j] = sum over t < len(choice) of log_softmax(logits[s, c - 1 + t])[choice[t]]
    Shape: input_ids, attention_mask [S, width] (S = choices in the batch, width = the longest
    sequence; mask 0 on padding); logits [S, width, vocab]; the scored positions [T] (T = choice
    tokens in the batch). Example: context [5, 6], choices [[7], [8, 9]] -> sequences [5, 6, 7, 0]
    and [5, 6, 8, 9]; scored (seq, position, target): (0, 1, 7), (1, 1, 8), (1, 2, 9).
    """
    seqs = [(context, choice) for context, choices in batch for choice in choices]
    width = _width(batch)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)  # [S, width]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [S, width], 0 on padding
    seq_of, pos, target = [], [], []
    for s, (context, choice) in enumerate(seqs):
        tokens = context + choice
        ids[s, : len(tokens)] = torch.tensor(tokens)
        mask[s, : len(tokens)] = 1
        seq_of += [s] * len(choice)
        pos += range(len(context) - 1, len(tokens) - 1)
        target += choice
    seq_of, pos, target = (torch.tensor(x, device=device) for x in (seq_of, pos, target))
    with torch.inference_mode():
        logits = model(
            input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
        ).logits  # [S, width, vocab]
        logp = torch.log_softmax(logits[seq_of, pos].float(), dim=-1)  # [T, vocab]
        picked = logp.gather(1, target[:, None])[:, 0]  # [T]
        sums = torch.zeros(len(seqs), dtype=torch.float64, device=device)
        sums = sums.index_add_(0, seq_of, picked.double()).tolist()  # [S]
    out, first = [], 0
    for _, choices in batch:
        out.append(sums[first : first + len(choices)])
        first += len(choices)
    return out


def _rows(workload: ScoreWorkload, ids: list[int]) -> list[tuple[list[int], list[list[int]]]]:
    return [(workload.contexts[i], workload.choices[i]) for i in ids]


def _width(batch: list[tuple[list[int], list[list[int]]]]) -> int:
    return max(len(context) + len(choice) for context, choices in batch for choice in choices)
