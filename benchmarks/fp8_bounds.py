"""FP8 KV accuracy against bounds relative to bf16's own noise, on the sample model and the random
test models.

    python -m benchmarks.fp8_bounds [--device cpu|cuda] [--kinds mha,gqa,qwen2] [--out DIR]

The bounds, relative to the noise bf16 brings by itself (e4m3 K and V at one scale per token and
head cannot be held to an absolute bound below bf16's own delta):
- log-probabilities: the mean |delta| of bf16 + fp8 KV against fp32 is at most
  ``MAX_DELTA_RATIO`` times that of bf16 against fp32, over the same tokens;
- greedy outputs: bf16 + fp8 KV gives bf16's first ``GREEDY_TOKENS`` tokens on at least
  ``MIN_SAME_GREEDY`` of the rows.

Sample model: the sample eval's 250 continuations (``fp8_accuracy.eval_requests``) for the
log-probabilities, and its 50 (question, adapter) rows generated greedily for the outputs.
Random test models (``tests/factory.py``: each kind's model and six adapters of ranks 1-64):
``--rows`` random prompts over the adapters and the base, generated greedily for
``GREEDY_TOKENS`` tokens (EOS ignored) in each precision, and fp32's outputs scored as
continuations in each precision for the log-probabilities.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.fp8_accuracy import JOB, ROOT, Setting, compare, eval_requests, score
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.engine import Engine
from slora_batch.engine.requests.request import Request
from slora_batch.jobs.config import load_jobs

MAX_DELTA_RATIO = 2.5
GREEDY_TOKENS = 32
MIN_SAME_GREEDY = 0.9
FP32, BF16 = Setting("fp32", "float32"), Setting("bf16", "bfloat16")
FP8_KV = Setting("bf16 + fp8 KV", "bfloat16", kv_cache_dtype="fp8")


def generate(model, adapters, requests: list[Request], setting: Setting, device: str) -> dict:
    """{request id: generated token ids} under ``setting``. Raises RuntimeError on error rows."""
    config = EngineConfig(
        device=device,
        dtype=setting.dtype,
        kv_cache_dtype=setting.kv_cache_dtype,
        backend="torch" if device == "cpu" else "auto",
    )
    with Engine(model, adapters=adapters, config=config, sampling=SamplingConfig()) as engine:
        results = list(engine.generate(requests))
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{setting.name}: {len(errors)} error rows, first: {errors[0]}")
    return {r.id: list(r.token_ids) for r in results}


def same_greedy(got: dict, want: dict, tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """The share of rows whose first ``tokens`` generated ids equal the reference's (a row that
    stopped earlier compares what it has), and, per row that differs, where it first does."""
    first = {}
    for key, w in want.items():
        g, w = got[key][:tokens], w[:tokens]
        if g != w:
            first[str(key)] = next(
                (i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                min(len(g), len(w)),
            )
    return {"rows": len(want), "same": 1 - len(first) / len(want), "first_difference": first}


def bounds(deltas: dict[str, dict], greedy: dict[str, Any]) -> list[dict[str, Any]]:
    """The two checks: fp8 KV's delta against fp32 over bf16's, and the greedy share."""
    ratio = deltas["fp8"]["mean_abs_delta"] / deltas["bf16"]["mean_abs_delta"]
    return [
        {
            "check": f"fp8 KV / bf16 mean |delta| against fp32 <= {MAX_DELTA_RATIO}",
            "value": ratio,
            "pass": ratio <= MAX_DELTA_RATIO,
        },
        {
            "check": f"first {GREEDY_TOKENS} greedy tokens equal bf16's >= {MIN_SAME_GREEDY:.0%}",
            "value": greedy["same"],
            "pass": greedy["same"] >= MIN_SAME_GREEDY,
        },
    ]


def measure(
    model,
    adapters,
    scored: list[Request],
    generated: list[Request],
    device: str,
    continuations_from_fp32: bool,
) -> dict[str, Any]:
    """Greedy outputs in fp32, bf16 and bf16 + fp8 KV; log-probabilities of ``scored`` (or, with
    ``continuations_from_fp32``, of fp32's outputs of ``generated``) in the three, against fp32."""
    outputs = {
        s.name: generate(model, adapters, generated, s, device) for s in (FP32, BF16, FP8_KV)
    }
    if continuations_from_fp32:
        # ids as compare() groups them: (row, adapter, choice), one choice a row
        scored = [
            dataclasses.replace(
                r,
                id=(r.id, r.adapter, 0),
                max_new_tokens=None,
                continuation_token_ids=outputs["fp32"][r.id],
                ignore_eos=None,
            )
            for r in generated
        ]
    logprobs = {s.name: score(model, adapters, scored, s, device)[0] for s in (FP32, BF16, FP8_KV)}
    deltas = {
        name: compare(logprobs[setting.name], logprobs["fp32"])
        for name, setting in (("bf16", BF16), ("fp8", FP8_KV))
    }
    greedy = same_greedy(outputs[FP8_KV.name], outputs[BF16.name])
    bf16_greedy = same_greedy(outputs[BF16.name], outputs["fp32"])
    return {
        "tokens": deltas["fp8"]["tokens"],
        "bf16_delta": deltas["bf16"]["mean_abs_delta"],
        "fp8_delta": deltas["fp8"]["mean_abs_delta"],
        "greedy": greedy,
        "bf16_greedy_vs_fp32": bf16_greedy["same"],
        "checks": bounds(deltas, greedy),
    }


def sample_rows() -> tuple[Any, list[Request], list[Request]]:
    """The sample job, its eval's scored continuations, and one greedy generation row per
    (question, adapter): the prompt, no choice."""
    job = load_jobs(JOB)[0]
    scored = eval_requests(JOB)
    rows = {}
    for r in scored:
        row_id, adapter, _ = r.id
        rows.setdefault(
            (row_id, adapter),
            dataclasses.replace(
                r,
                id=(row_id, adapter),
                continuation=None,
                max_new_tokens=GREEDY_TOKENS,
                temperature=0.0,
            ),
        )
    return job, scored, list(rows.values())


def sample_case(device: str) -> dict[str, Any]:
    job, scored, generated = sample_rows()
    return measure(job.model, job.adapters, scored, generated, device, False)


def _tests_on_path() -> None:
    """tests/ on sys.path: its factory builds the random test models."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))


def add_case_args(parser: argparse.ArgumentParser) -> None:
    """The options that pick the models compared: the device, the random test models (the
    test factory's kinds by default), their prompts, and whether the sample model runs."""
    _tests_on_path()
    from factory import KINDS

    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kinds", default=",".join(KINDS), help="random test models")
    parser.add_argument("--rows", type=int, default=60, help="prompts per random model")
    parser.add_argument("--no-sample", action="store_true", help="random models only")


@contextlib.contextmanager
def random_rows(kind: str, rows: int):
    """The test suite's random model of ``kind`` (tests/factory.py) and its adapters in a
    temporary directory, with ``rows`` greedy generation rows over them: (model, adapters by
    name -> path string, requests)."""
    _tests_on_path()
    from factory import make_adapters, make_model, make_rows

    with tempfile.TemporaryDirectory(prefix=f"fp8-{kind}-") as tmp:
        model = make_model(Path(tmp), kind)
        adapters = make_adapters(model, Path(tmp) / "adapters")
        generated = [
            Request(
                id=row["id"],
                adapter=row["adapter"],
                prompt_token_ids=row["prompt_token_ids"],
                temperature=0.0,
                max_new_tokens=GREEDY_TOKENS,
                ignore_eos=True,
            )
            for row in make_rows(rows, 300, list(adapters), seed=7)
        ]
        yield model, {n: str(p) for n, p in adapters.items()}, generated


def random_case(kind: str, rows: int, device: str) -> dict[str, Any]:
    with random_rows(kind, rows) as (model, adapters, generated):
        return measure(model, adapters, [], generated, device, True)


def markdown(cases: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | tokens | bf16 vs fp32 (nats) | fp8 KV vs fp32 (nats) | ratio | greedy rows "
        f"| first {GREEDY_TOKENS} equal bf16's | bf16's equal fp32's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in cases.items():
        ratio, same = (check["value"] for check in c["checks"])
        verdict = " ".join("pass" if check["pass"] else "FAIL" for check in c["checks"])
        lines.append(
            f"| {name} | {c['tokens']} | {c['bf16_delta']:.4f} | {c['fp8_delta']:.4f} "
            f"| {ratio:.2f} | {c['greedy']['rows']} | {same:.1%} "
            f"| {c['bf16_greedy_vs_fp32']:.1%} | {verdict} |"
        )
    lines[0] += " verdict |"
    lines[1] += "---|"
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser)
    parser.add_argument("--out", default="out/fp8-bounds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cases = {} if args.no_sample else {"smollm2-135m (sample)": sample_case(args.device)}
    for kind in filter(None, args.kinds.split(",")):
        cases[f"random {kind}"] = random_case(kind, args.rows, args.device)
    write_cases(Path(args.out), "fp8-bounds", cases, markdown(cases))


def write_cases(out: Path, stem: str, cases: dict, table: str) -> None:
    """``table`` to out/STEM.md and the cases to out/STEM.json, and the table to stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(table)
    (out / f"{stem}.json").write_text(json.dumps(cases, indent=2, default=str) + "\n")
    print(table, end="")


if __name__ == "__main__":
    main()
