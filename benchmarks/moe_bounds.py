"""How close slora can come to the base model on the MoE workload, step by step at the floor:
the standard requests on Qwen3-30B-A3B shapes scheduled as the engine schedules them, each step
timed at its floor (``bench/floor.py``), for the base model and for adapters on attention
(slora@1000) or on the experts (slora@100), on a card of a given memory.

    python -m benchmarks.moe_bounds [--pool-gib 17 77] [--rows 1024] [--json FILE]

What it models: rows admitted in adapter order (as the engine gets them), at most ``--rows`` at
once and ``--max-adapters`` distinct adapters (EngineConfig.max_adapters_per_batch), while the
pool holds every running row's KV at its current length plus the pages of every adapter a row
runs (an adapter must be resident for its rows to step). Each admission is a prefill step
(FLOP-bound: 2 x active parameters x prompt tokens at the matmul rate, or its bytes where
larger); then every running row decodes one token a step, the step reading the weights its
tokens reach, its rows' KV and its adapters' rows (``floor.AdapterRows``' rule: the whole
attention rows, the expert rows of the experts its own tokens reach). No preemption, no host
time, no kernel below the copy bandwidth: the base model and slora each at their floor. The
ratio slora / base of these floor throughputs is what slora reaches when both run at the same
fraction of their floor; the engines measured so far run slora at a lower fraction than base
(the extra LoRA kernels), so it is an upper estimate.

Pools: the H100's measured pool beside the 61 GB of weights at ``max_num_seqs: auto`` is 17 GiB;
an H200 has 60.6 GiB more memory, so about 77 GiB.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import torch

from slora_batch.bench.bench import BenchConfig
from slora_batch.bench.floor import Routing, WeightBytes
from slora_batch.bench.model import EXPERT_RANKS, RANKS, active_params, build_model
from slora_batch.bench.workload import Workload, group_by_adapter
from slora_batch.engine.models.spec import EXPERT_TARGETS, ModelSpec

GIB = 1 << 30
ATTENTION = ("q", "k", "v", "o")
PRESET = "qwen3-30b-a3b"


@dataclass(frozen=True)
class Card:
    pool_bytes: float
    copy_bytes_per_s: float = 3.0e12  # H100 measured ~3.0 TB/s, H200 ~4.2
    matmul_flops_per_s: float = 6.6e14


@dataclass(frozen=True)
class AdapterBytes:
    """An adapter's pool bytes: ``whole`` (attention rows, read whole by a step) and ``expert``
    (one expert's rows in one layer)."""

    whole: int
    expert: int

    def total(self, spec: ModelSpec) -> int:
        return self.whole + self.expert * spec.num_experts * Routing.of(spec).moe_layers

    def read(self, spec: ModelSpec, tokens: int) -> float:
        routing = Routing.of(spec)
        return self.whole + routing.moe_layers * routing.touched(tokens) * self.expert


def adapter_bytes(spec: ModelSpec, rank: int, experts: bool) -> AdapterBytes:
    """The pages of one adapter of ``rank`` on q, k, v, o (and on the experts, at its rank)."""
    page = spec.page_size * 2 * spec.num_layers  # bf16, one page spans every layer
    whole = spec.adapter_pages(rank, ATTENTION) * page
    if not experts:
        return AdapterBytes(whole, 0)
    targets = tuple(EXPERT_TARGETS)
    pages = spec.adapter_pages(rank, targets, dict.fromkeys(targets, rank))
    per_layer = spec.page_size * 2  # an expert target's rows hold pages of one layer each
    return AdapterBytes(whole, pages * per_layer // spec.num_experts)


@dataclass
class Row:
    adapter: str | None
    context: int
    left: int


@dataclass(frozen=True)
class Setting:
    """What a simulated run runs on: the model's floor figures, the card and the engine's caps."""

    spec: ModelSpec
    weights: WeightBytes
    kv_token: int  # KV bytes a token
    active: int  # parameters a token computes with
    card: Card
    max_rows: int = 1024
    max_adapters: int = 256

    @classmethod
    def of(cls, model, card: Card, max_rows: int = 1024, max_adapters: int = 256) -> Setting:
        """The setting of a bench model (``bench.model.build_model``) in bf16."""
        spec = model.spec
        weights = WeightBytes.of(spec, model.num_params, 2)
        active = active_params(spec, model.num_params)
        return cls(spec, weights, model.kv_bytes_per_token, active, card, max_rows, max_adapters)


def simulate(run: Setting, rows, names, sizes) -> tuple[float, float, float]:
    """Floor seconds, output tokens and decode steps of one run (see the module docstring):
    ``rows`` (prompt length, output length) on adapters ``names`` of ``sizes``."""
    queue = deque(zip(names, rows, strict=True))
    running: list[Row] = []
    seconds = tokens = steps = 0.0
    card = run.card
    while queue or running:
        seconds += _admit(run, queue, running, sizes)
        if not running:
            raise RuntimeError("a row does not fit the pool alone")
        per_adapter = Counter(r.adapter for r in running if r.adapter)
        read = run.weights.step(len(running)) + run.kv_token * sum(r.context for r in running)
        read += sum(sizes[a].read(run.spec, n) for a, n in per_adapter.items())
        flops = 2 * run.active * len(running)
        seconds += max(read / card.copy_bytes_per_s, flops / card.matmul_flops_per_s)
        tokens += len(running)
        steps += 1
        for r in running:
            r.context += 1
            r.left -= 1
        running[:] = [r for r in running if r.left > 0]
    return seconds, tokens, steps


def _admit(run: Setting, queue: deque, running: list[Row], sizes) -> float:
    """Admits rows from the head of ``queue`` while they fit; the seconds of their prefill."""
    used = run.kv_token * sum(r.context for r in running)
    resident = {r.adapter for r in running if r.adapter}
    used += sum(sizes[a].total(run.spec) for a in resident)
    prompt = 0
    while queue and len(running) < run.max_rows:
        adapter, (length, out) = queue[0]
        new = adapter and adapter not in resident
        if new and len(resident) >= run.max_adapters:
            break
        need = run.kv_token * length + (sizes[adapter].total(run.spec) if new else 0)
        if used + need > run.card.pool_bytes:
            break
        queue.popleft()
        used += need
        if new:
            resident.add(adapter)
        running.append(Row(adapter, length, out))
        prompt += length
    if not prompt:
        return 0.0
    flops = 2 * run.active * prompt / run.card.matmul_flops_per_s
    return max(flops, run.weights.step(prompt) / run.card.copy_bytes_per_s)


def bounds(pool_gib: float, max_rows: int, copy: float, matmul: float, max_adapters: int) -> dict:
    config = BenchConfig(model_preset=PRESET, max_adapters_per_batch=max_adapters)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(PRESET, torch.device("cpu"), torch.bfloat16, Path(tmp), 0, hf=False)
    run = Setting.of(model, Card(pool_gib * GIB, copy, matmul), max_rows, max_adapters)
    spec = run.spec
    workload = Workload.generate(config, spec.vocab_size)
    figures = {"pool_gib": pool_gib, "max_rows": max_rows, "max_adapters": max_adapters}
    for label, n, experts, ranks in (
        ("base", 0, False, RANKS),
        ("attention@1000", 1000, False, RANKS),
        ("experts@100", 100, True, EXPERT_RANKS),
    ):
        requests = group_by_adapter(workload.requests(n))
        names = [r.adapter for r in requests]
        rows = [(len(r.prompt_token_ids), r.max_new_tokens) for r in requests]
        sizes = {
            name: adapter_bytes(spec, ranks[int(name[1:]) % len(ranks)], experts)
            for name in set(names)
            if name
        }
        seconds, tokens, steps = simulate(run, rows, names, sizes)
        figures[label] = tokens / seconds
        figures[f"{label} batch"] = tokens / steps
    for label in ("attention@1000", "experts@100"):
        figures[f"{label} / base"] = figures[label] / figures["base"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-gib", type=float, nargs="+", default=[17.0, 77.0])
    parser.add_argument("--rows", type=int, default=1024, help="max_num_seqs' bound")
    parser.add_argument(
        "--max-adapters",
        type=int,
        default=BenchConfig.max_adapters_per_batch,
        help="max_adapters_per_batch",
    )
    parser.add_argument("--copy", type=float, default=3.0e12, help="bytes/s")
    parser.add_argument("--matmul", type=float, default=6.6e14, help="FLOP/s")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = [
        bounds(p, args.rows, args.copy, args.matmul, args.max_adapters) for p in args.pool_gib
    ]
    for figures in results:
        print(
            " ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()
            )
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
