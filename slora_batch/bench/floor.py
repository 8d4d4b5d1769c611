"""The honest floor of an engine run, step by step: ``floor_fraction`` beside the old roofline.

The roofline (``roofline.py``) takes max(FLOPs, KV bytes) over the whole run and leaves out the
weights and adapter rows every step reads. Here each step the engine launched costs at least

    max(bytes / copy bandwidth, FLOPs / matmul rate)
    bytes = weight bytes + KV bytes of the positions its rows read
            + the row bytes of its distinct adapters
    FLOPs = 2 x active parameters x tokens computed

and the run's floor is the sum over its steps. A decode step is bytes-bound on every preset and
batch here but at the largest; a prefill chunk is FLOP-bound. The parts say which term each step
took: ``floor_weight_s + floor_kv_s + floor_adapter_s`` over bytes-bound steps plus
``floor_flops_s`` over FLOP-bound ones add up to ``floor2_s``; ``floor_fraction`` is ``floor2_s``
over the measured seconds.

A dense model's step reads every weight once (``WeightBytes.dense``). A mixture-of-experts
model's reads its weights but the experts once, and in each MoE layer the experts its T tokens
reach: E (1 - (1 - k/E)^T) of them in expectation when each token picks k of E at random
(``Routing.touched``; a trained router spreads tokens roughly so, the bench's random one too).
Its FLOPs count the active parameters (the k experts a token runs, not all E). An adapter's row
bytes are its rows on attention and the router whole, and on the experts those of the experts
its own tokens reach: the (adapter, expert) pairs the step touches (``AdapterRows``).

Running example: a decode step of 3 rows at contexts 10, 20, 30 on two adapters of 1 MB each,
weights 100 MB, KV 1 kB a token, 1 GB/s: bytes = 100 + 0.06 + 2 MB -> 0.10206 s; 3 tokens of a
50M-parameter model at 1 TFLOP/s: 0.0003 s; the step adds 0.1 s to floor_weight_s, 0.00006 s to
floor_kv_s and 0.002 s to floor_adapter_s. The same step on 2 MoE layers of 4 experts of 10 MB
each, top 2, beside 20 MB of other weights: each layer's 3 tokens reach 4 (1 - (1/2)^3) = 3.5
experts in expectation, so the weights read are 20 + 2 x 3.5 x 10 = 90 MB.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from slora_batch.bench.roofline import Rates
from slora_batch.engine.models.spec import EXPERT_TARGETS, ModelSpec

PARTS = ("floor_weight_s", "floor_kv_s", "floor_adapter_s", "floor_flops_s")


@dataclass(frozen=True)
class Routing:
    """How a mixture-of-experts model's tokens reach its experts, as the floor counts them:
    each of ``moe_layers`` layers sends a token to ``top_k`` of ``experts``, uniformly at
    random. A dense model: no experts (``touched`` is 0)."""

    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0

    @classmethod
    def of(cls, spec: ModelSpec) -> Routing:
        layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
        return cls(spec.num_experts, spec.experts_per_token, layers)

    def touched(self, tokens: int) -> float:
        """Expected distinct experts that ``tokens`` tokens reach in one layer: each misses a
        given expert with probability 1 - k/E, so E (1 - (1 - k/E)^T). Example, E 128, k 8:
        1 token 8, 16 tokens 82.4, 256 tokens 128.0 (every expert but 1e-5 of one)."""
        if not self.experts or tokens <= 0:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)


@dataclass(frozen=True)
class WeightBytes:
    """The base weight bytes a step reads: ``dense`` (every weight but the experts and the
    embedding table, read whole by every step) and, per MoE layer, ``expert`` bytes (one
    expert's gate, up and down) for each expert its tokens reach."""

    dense: int
    expert: int = 0
    routing: Routing = field(default_factory=Routing)

    @classmethod
    def of(cls, spec: ModelSpec, num_params: int, elt: int) -> WeightBytes:
        """The weight bytes of a model of ``num_params`` parameters, ``elt`` bytes each."""
        routing = Routing.of(spec)
        expert = 3 * spec.hidden_size * spec.expert_size  # parameters of one expert
        experts = routing.moe_layers * spec.num_experts * expert
        dense = weight_bytes(
            num_params - experts, spec.vocab_size, spec.hidden_size, spec.tie_word_embeddings, elt
        )
        return cls(dense, expert * elt, routing)

    def step(self, tokens: int) -> float:
        """Bytes a step of ``tokens`` tokens reads (``dense`` on a dense model)."""
        return self.dense + self.routing.moe_layers * self.routing.touched(tokens) * self.expert


class AdapterRows:
    """The row bytes of one adapter that a step reads for ``tokens`` of its tokens (in the
    page layout the pool holds): its rows on attention and the router whole; on the experts,
    per MoE layer, the rows of the experts those tokens reach (``Routing.touched``). Example:
    rank 16 on Qwen3-30B-A3B's experts, 13 pages of 512 a row, is 16 x 13 x 1 KiB = 208 KiB an
    expert and layer; 20 tokens reach 92.8 of 128 experts, so 48 x 92.8 x 208 KiB = 0.88 GiB of
    its 1.22 GiB of expert rows."""

    def __init__(self, store, routing: Routing) -> None:
        self.store, self.routing = store, routing
        self._split: dict[str, tuple[int, int]] = {}

    def __call__(self, name: str, tokens: int) -> float:
        whole, expert = self._split.get(name) or self._parts(name)
        if not expert:
            return whole
        return whole + self.routing.moe_layers * self.routing.touched(tokens) * expert

    def _parts(self, name: str) -> tuple[int, int]:
        """(bytes read whole, bytes of one expert in one layer) of an adapter, from its pages."""
        store = self.store
        info = store.info(name)
        targets = tuple(t for t in info.targets if t in EXPERT_TARGETS)
        total = store.nbytes(name)
        if not targets:
            split = (total, 0)
        else:
            spec = store.page_spec
            page = spec.page_size * (torch.finfo(store.dtype).bits // 8)  # one layer's page
            pages = spec.adapter_pages(info.rank, targets, info.expert_ranks)  # E blocks
            split = (total - pages * store.spec.num_layers * page, pages * page // spec.num_experts)
        self._split[name] = split
        return split


@dataclass(frozen=True)
class StepWork:
    """What one launched step asked of the device."""

    tokens: int  # tokens computed (decode rows 1 each, prefill chunks their length)
    kv_tokens: int  # cached positions its rows attend to, summed over rows
    adapter_bytes: float  # row bytes of its distinct adapters (``AdapterRows``)


def trace_steps(engine, routing: Routing | None = None) -> list[StepWork]:
    """Wraps ``engine._launch`` (as ``benchmarks/trace_steps.py`` does) so that each step it
    launches appends its ``StepWork`` to the returned list; the engine itself is unchanged.
    ``routing``: the model's (expert adapters' rows by the experts their tokens reach)."""
    trace: list[StepWork] = []
    launch = engine._launch
    rows = AdapterRows(engine.store, routing or Routing())

    def traced(step, started, prev):
        tokens: Counter[str] = Counter()
        for seq, n in zip(step.seqs, step.num_new, strict=True):
            if seq.adapter:
                tokens[seq.adapter] += n
        trace.append(
            StepWork(
                tokens=sum(step.num_new),
                kv_tokens=sum(s.num_computed for s in step.seqs) + sum(step.num_new),
                adapter_bytes=sum(rows(a, n) for a, n in tokens.items()),
            )
        )
        return launch(step, started, prev)

    engine._launch = traced
    return trace


def weight_bytes(num_params: int, vocab: int, hidden: int, tied: bool, elt: int) -> int:
    """Weight bytes a step reads: every parameter but the embedding table, of which a step
    gathers a few rows only (a tied table is read whole as the output head)."""
    return (num_params - (0 if tied else vocab * hidden)) * elt


def floor_parts(
    trace: list[StepWork],
    weights: WeightBytes,
    kv_bytes_per_token: int,
    active_params: int,
    rates: Rates,
    devices: int = 1,
) -> dict[str, float]:
    """``PARTS`` and ``floor2_s`` (their sum) of a traced run, on ``devices`` cards like the
    one measured (each reads and computes 1/devices of a step)."""
    parts = dict.fromkeys(PARTS, 0.0)
    bandwidth = rates.copy_bytes_per_s * devices
    for step in trace:
        byte_terms = (
            weights.step(step.tokens) / bandwidth,
            step.kv_tokens * kv_bytes_per_token / bandwidth,
            step.adapter_bytes / bandwidth,
        )
        flops_s = 2.0 * active_params * step.tokens / (rates.matmul_flops_per_s * devices)
        if flops_s > sum(byte_terms):
            parts["floor_flops_s"] += flops_s
        else:
            for name, seconds in zip(PARTS, byte_terms, strict=False):
                parts[name] += seconds
    parts["floor2_s"] = sum(parts[name] for name in PARTS)
    return parts
