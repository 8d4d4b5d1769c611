"""What a step brings back from the device, and the step in flight until it does.

``step_outputs`` turns a step's logits into its outputs on the device: the drawn tokens
(sampled, or the argmax when every drawn row is greedy), the scored tokens' log-probabilities
(``scoring``), and the logprobs of the drawn rows that asked for them. ``Inflight`` holds them
until the engine reads them back one step later; ``take_outputs`` writes what came back into the
sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slora_batch.engine.device import to_device
from slora_batch.engine.execution.batch import HostStep
from slora_batch.engine.execution.masks import GrammarMasks
from slora_batch.engine.requests.sampling import SamplingBatch, sample
from slora_batch.engine.requests.sequence import Sequence
from slora_batch.engine.scheduling.rows import RowTable
from slora_batch.engine.scheduling.scheduler import ScheduledStep


@dataclass
class Inflight:
    """A launched step whose outputs (drawn tokens, scores, logprobs) are not read back yet."""

    number: int
    step: ScheduledStep
    host: HostStep
    drawn: list[Sequence]  # the sequences that draw a token, in the order of the tokens
    outputs: dict[str, torch.Tensor]  # on the device: "tokens", "scores", "logprobs"
    started: float
    host_s: float
    # On cuda: the outputs copied to pinned host memory, and the event after those copies.
    # Reading them waits for this step alone, not for the step queued after it.
    copies: dict[str, torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None

    @property
    def tokens(self) -> torch.Tensor | None:
        return self.outputs.get("tokens")

    def read(self) -> dict[str, torch.Tensor]:
        if self.ready is None:
            return self.outputs
        self.ready.synchronize()
        return self.copies

    def copy_to_host(self) -> None:
        """Queues the outputs' copies to pinned host memory and the event after them (cuda)."""
        self.copies = {
            name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for name, t in self.outputs.items()
        }
        self.ready = torch.cuda.Event()
        self.ready.record()


def step_outputs(
    logits: torch.Tensor,
    host: HostStep,
    drawn: list[Sequence],
    masks: GrammarMasks | None = None,
    table: RowTable | None = None,
) -> dict:
    """The step's outputs on the device, from its logits: the drawn rows' first, then the
    scored tokens' (``HostStep.score_index``). ``masks`` (rows with a grammar) cut the drawn
    rows' logits before anything reads them: their tokens and logprobs come from the masked
    distribution. ``table``: the row table whose first rows ``drawn`` are
    (``ScheduledStep.rows``), whose columns give the sampling parameters."""
    outputs = {}
    if host.score_index is not None:
        outputs["scores"] = score_tokens(logits[len(drawn) :], host.score_targets)
        logits = logits[: len(drawn)]
    if masks is not None:
        logits = logits[: len(drawn)]
        masks.apply(logits)
    if drawn and _any_sampled(drawn, table):
        if table is not None:
            d = len(drawn)
            steps = table.b_outputs[:d] + table.b_pending[:d]  # num_drawn
            params = SamplingBatch.build(
                table.b_temperature[:d],
                table.b_top_k[:d],
                table.b_top_p[:d],
                table.b_noise[:d],
                steps,
                logits.device,
            )
        else:
            steps = [s.num_drawn for s in drawn]
            params = SamplingBatch.build(
                [s.temperature for s in drawn],
                [s.top_k for s in drawn],
                [s.top_p for s in drawn],
                [s.key for s in drawn],
                steps,
                logits.device,
            )
        outputs["tokens"] = sample(logits, params)
    elif drawn:  # all greedy: sample()'s argmax, without building its parameters
        outputs["tokens"] = logits.argmax(dim=-1)
    rows = []
    if table is None or table.logprobs:  # the table counts its rows that ask
        rows = [i for i, s in enumerate(drawn) if s.logprobs is not None]
    if rows:  # rows asked for logprobs: theirs only
        index = to_device(rows, logits.device)
        temperatures = [drawn[i].temperature for i in rows]
        k = max(drawn[i].logprobs for i in rows)
        tokens = outputs["tokens"][index]
        outputs["logprobs"] = top_logprobs(logits[index], tokens, temperatures, k)
    return outputs


def _any_sampled(drawn: list[Sequence], table: RowTable | None) -> bool:
    if table is not None:
        return bool((table.b_temperature[: len(drawn)] > 0).any())
    return any(s.temperature > 0 for s in drawn)


def score_tokens(logits, targets):
    """[E, 2] fp32 on the logits' device: each row's log-probability of its target token (a
    log-softmax over the vocabulary of those rows only) and 1.0 where the target is the argmax."""
    targets = to_device(targets, logits.device)
    picked = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    greedy = (logits.argmax(dim=-1) == targets).float()
    return torch.stack([picked, greedy], dim=1)


def top_logprobs(logits, tokens, temperatures: list[float], k: int):
    """[W, 1 + 2k] fp32: for each row, the drawn token's log-probability, then the ids and the
    log-probabilities of the k most likely tokens, under the distribution the sampler drew
    from before its top-k / top-p cut: softmax(logits / temperature), the logits themselves for
    greedy rows (temperature 0)."""
    scale = to_device([t if t > 0 else 1.0 for t in temperatures], logits.device, torch.float32)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    drawn = logp.gather(1, tokens[:, None])
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    return torch.cat([drawn, ids.float(), values], dim=1)


def take_outputs(host, seqs: list, drawn: list, outputs: dict, tokens: list[int]) -> None:
    """A read-back step's scores into its scored sequences, and its logprobs into the entries
    of the drawn rows that asked for them (before the tokens themselves are appended)."""
    if "scores" in outputs:
        values = outputs["scores"].numpy()
        for owner, pos, (value, greedy) in zip(
            host.score_owner, host.score_pos, values, strict=True
        ):
            seqs[owner].scores.logprobs[pos] = value
            seqs[owner].scores.greedy[pos] = greedy > 0.5
    if "logprobs" in outputs:
        table = outputs["logprobs"].numpy()
        width = (table.shape[1] - 1) // 2
        rows = [i for i, s in enumerate(drawn) if s.logprobs is not None]
        for values, row in zip(table, rows, strict=True):
            seq, k = drawn[row], drawn[row].logprobs
            ids = values[1 : 1 + k].astype(np.int64)
            seq.logprob_entries.append(
                (tokens[row], values[0], ids, values[1 + width : 1 + width + k])
            )
