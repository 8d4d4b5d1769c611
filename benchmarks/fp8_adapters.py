"""FP8 adapters (``adapter_dtype: fp8``) against model-dtype adapters, on the sample model and the
random test models: greedy agreement and log-probability deltas.

    python -m benchmarks.fp8_adapters [--device cpu|cuda] [--kinds mha,gqa] [--bf16] [--out DIR]

For each model: greedy outputs (first ``GREEDY_TOKENS`` tokens) and the log-probabilities of
fp32's outputs as continuations (sample model: the sample eval's continuations), under
- fp32 with fp32 adapters (the reference), and fp32 with fp8 adapters: fp8's own effect
  (the CPU figure);
- with ``--bf16`` (default on cuda) also bf16 with bf16 adapters and bf16 with fp8 adapters:
  fp8 adapters' delta against fp32 relative to bf16's own, as ``fp8_bounds`` does for the KV
  cache.
Random test models (``tests/factory.py``): each kind's model and six adapters of ranks 1-64 (their
random weights, |w| ~ 0.16, make these models far more sensitive than a trained one).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from benchmarks.fp8_accuracy import Setting, compare, score
from benchmarks.fp8_bounds import (
    GREEDY_TOKENS,
    add_case_args,
    random_rows,
    same_greedy,
    sample_rows,
    write_cases,
)
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.engine import Engine
from slora_batch.engine.requests.request import Request

FP32, BF16 = Setting("fp32", "float32"), Setting("bf16", "bfloat16")
FP8 = "fp8"  # adapter_dtype of the fp8 settings


def generate(model, adapters, requests: list[Request], dtype: str, adapter_dtype: str, device):
    """{request id: generated token ids}. Raises RuntimeError on error rows."""
    config = EngineConfig(device=device, dtype=dtype, adapter_dtype=adapter_dtype,
                          backend="torch" if device == "cpu" else "auto")  # fmt: skip
    with Engine(model, adapters=adapters, config=config, sampling=SamplingConfig()) as engine:
        results = list(engine.generate(requests))
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{dtype}/{adapter_dtype}: {len(errors)} error rows: {errors[0]}")
    return {r.id: list(r.token_ids) for r in results}


def measure(model, adapters, scored, generated, device, bf16: bool, from_fp32: bool) -> dict:
    """Greedy outputs and log-probabilities in each setting against fp32 with fp32 adapters."""
    settings = [(FP32, "auto"), (FP32, FP8)] + ([(BF16, "auto"), (BF16, FP8)] if bf16 else [])
    outputs = {
        (s.name, a): generate(model, adapters, generated, s.dtype, a, device) for s, a in settings
    }
    if from_fp32:  # fp32's outputs scored as continuations; ids as compare() groups them
        scored = [
            dataclasses.replace(r, id=(r.id, r.adapter, 0), max_new_tokens=None, ignore_eos=None,
                                continuation_token_ids=outputs[("fp32", "auto")][r.id])
            for r in generated
        ]  # fmt: skip
    logprobs = {
        (s.name, a): score(model, adapters, scored, s, device, adapter_dtype=a)[0]
        for s, a in settings
    }
    reference = logprobs[("fp32", "auto")]
    figures = {"tokens": compare(logprobs[("fp32", FP8)], reference)["tokens"]}
    for (name, adapter_dtype), scores in logprobs.items():
        if (name, adapter_dtype) == ("fp32", "auto"):
            continue
        label = f"{name} + {adapter_dtype} adapters"
        figures[label] = {
            "mean_abs_delta": compare(scores, reference)["mean_abs_delta"],
            "greedy_vs_fp32": same_greedy(
                outputs[(name, adapter_dtype)], outputs[("fp32", "auto")]
            ),
        }
    if bf16:
        figures["bf16 + fp8 greedy vs bf16"] = same_greedy(
            outputs[("bf16", FP8)], outputs[("bf16", "auto")]
        )
    return figures


def sample_case(device: str, bf16: bool) -> dict[str, Any]:
    job, scored, generated = sample_rows()
    return measure(job.model, job.adapters, scored, generated, device, bf16, False)


def random_case(kind: str, rows: int, device: str, bf16: bool) -> dict[str, Any]:
    with random_rows(kind, rows) as (model, adapters, generated):
        return measure(model, adapters, [], generated, device, bf16, True)


def markdown(cases: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | setting | tokens | mean abs logprob delta vs fp32 (nats) "
        f"| first {GREEDY_TOKENS} greedy tokens equal fp32's |",
        "|---|---|---:|---:|---:|",
    ]
    for name, c in cases.items():
        for label, f in c.items():
            if not isinstance(f, dict) or "mean_abs_delta" not in f:
                continue
            lines.append(
                f"| {name} | {label} | {c['tokens']} | {f['mean_abs_delta']:.5f} "
                f"| {f['greedy_vs_fp32']['same']:.1%} of {f['greedy_vs_fp32']['rows']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser)
    parser.add_argument("--bf16", action="store_true", help="bf16 settings too (on cuda: always)")
    parser.add_argument("--out", default="out/fp8-adapters")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    bf16 = args.bf16 or args.device == "cuda"
    cases = {} if args.no_sample else {"smollm2-135m (sample)": sample_case(args.device, bf16)}
    for kind in filter(None, args.kinds.split(",")):
        cases[f"random {kind}"] = random_case(kind, args.rows, args.device, bf16)
    write_cases(Path(args.out), "fp8-adapters", cases, markdown(cases))


if __name__ == "__main__":
    main()
