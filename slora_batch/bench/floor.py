"""The honest floor of an engine run, step by step: ``floor_fraction`` beside the old roofline.

The roofline (``roofline.py``) takes max(FLOPs, KV bytes) over the whole run and leaves out the
weights and adapter rows every step reads. Here each step the engine launched costs at least

    max(bytes / copy bandwidth, FLOPs / matmul rate)
    bytes = weight bytes (once a step) + KV bytes of the positions its rows read
            + the row bytes of its distinct adapters
    FLOPs = 2 x parameters x tokens computed

and the run's floor is the sum over its steps. A decode step is bytes-bound on every preset and
batch here but at the largest; a prefill chunk is FLOP-bound. The parts say which term each step
took: ``floor_weight_s + floor_kv_s + floor_adapter_s`` over bytes-bound steps plus
``floor_flops_s`` over FLOP-bound ones add up to ``floor2_s``; ``floor_fraction`` is ``floor2_s``
over the measured seconds.

Running example: a decode step of 3 rows at contexts 10, 20, 30 on two adapters of 1 MB each,
weights 100 MB, KV 1 kB a token, 1 GB/s: bytes = 100 + 0.06 + 2 MB -> 0.10206 s; 3 tokens of a
50M-parameter model at 1 TFLOP/s: 0.0003 s; the step adds 0.1 s to floor_weight_s, 0.00006 s to
floor_kv_s and 0.002 s to floor_adapter_s.
"""

from __future__ import annotations

from dataclasses import dataclass

from slora_batch.bench.roofline import Rates

PARTS = ("floor_weight_s", "floor_kv_s", "floor_adapter_s", "floor_flops_s")


@dataclass(frozen=True)
class StepWork:
    """What one launched step asked of the device."""

    tokens: int  # tokens computed (decode rows 1 each, prefill chunks their length)
    kv_tokens: int  # cached positions its rows attend to, summed over rows
    adapter_bytes: int  # row bytes of its distinct adapters


def trace_steps(engine) -> list[StepWork]:
    """Wraps ``engine._launch`` (as ``benchmarks/trace_steps.py`` does) so that each step it
    launches appends its ``StepWork`` to the returned list; the engine itself is unchanged."""
    trace: list[StepWork] = []
    launch, store = engine._launch, engine.store

    def traced(step, started, prev):
        adapters = {seq.adapter for seq in step.seqs if seq.adapter}
        trace.append(
            StepWork(
                tokens=sum(step.num_new),
                kv_tokens=sum(s.num_computed for s in step.seqs) + sum(step.num_new),
                adapter_bytes=sum(store.nbytes(a) for a in adapters),
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
    weights: int,
    kv_bytes_per_token: int,
    num_params: int,
    rates: Rates,
    devices: int = 1,
) -> dict[str, float]:
    """``PARTS`` and ``floor2_s`` (their sum) of a traced run, on ``devices`` cards like the
    one measured (each reads and computes 1/devices of a step)."""
    parts = dict.fromkeys(PARTS, 0.0)
    bandwidth = rates.copy_bytes_per_s * devices
    for step in trace:
        byte_terms = (
            weights / bandwidth,
            step.kv_tokens * kv_bytes_per_token / bandwidth,
            step.adapter_bytes / bandwidth,
        )
        flops_s = 2.0 * num_params * step.tokens / (rates.matmul_flops_per_s * devices)
        if flops_s > sum(byte_terms):
            parts["floor_flops_s"] += flops_s
        else:
            for name, seconds in zip(PARTS, byte_terms, strict=False):
                parts[name] += seconds
    parts["floor2_s"] = sum(parts[name] for name in PARTS)
    return parts
