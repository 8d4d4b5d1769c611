"""The per-step device-time table of benchmarks/trace_steps.py on a hand-made trace."""

import json

import pytest

from benchmarks.trace_steps import family, step_table


def _trace(tmp_path):
    def step(n, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": f"step:{n}", "ts": ts, "dur": dur}

    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
                "args": {"correlation": corr}}  # fmt: skip

    def kernel(corr, name, ts, dur, stream=7, cat="kernel", **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "stream": stream, **args}}  # fmt: skip

    events = [
        step(0, 0, 50), launch(1, 10), launch(2, 20),
        step(1, 60, 40), launch(3, 70), launch(4, 80), launch(5, 90),
        step(2, 120, 10), launch(6, 125),
        launch(9, 105),  # outside every step: a prefetch copy on the side stream
        kernel(1, "nvjet_sm90_tst_128x64", 100, 300),
        kernel(2, "_shrink_vector_kernel", 400, 100),
        kernel(3, "_prefill_kernel", 1000, 200),  # the GPU idled 500 us before it
        kernel(4, "_expand_kernel", 1200, 100),
        kernel(5, "Memcpy HtoD", 1300, 50, cat="gpu_memcpy"),
        kernel(6, "_decode_split_kernel", 2000, 100),
        kernel(9, "Memcpy HtoD (Pinned -> Device)", 500, 1000, stream=9, cat="gpu_memcpy",
               bytes=64_000_000),
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_step_table_sums_each_steps_device_time_by_kind_and_family(tmp_path):
    marks = [
        dict(kind="decode", rows=4, prefill_tokens=0, adapters=2, prefill_adapters=0),
        dict(kind="mixed", rows=5, prefill_tokens=300, adapters=3, prefill_adapters=1),
        dict(kind="decode", rows=4, prefill_tokens=0, adapters=2, prefill_adapters=0),
    ]
    table, figures = step_table(_trace(tmp_path), marks)
    decode, mixed = figures["decode"], figures["mixed"]
    assert decode["steps"] == 1 and mixed["steps"] == 1  # the last step has no period
    assert decode["period_ms"] == pytest.approx(0.9) and decode["busy_ms"] == pytest.approx(0.4)
    assert decode["families_ms"]["gemm"] == pytest.approx(0.3)
    assert decode["families_ms"]["lora-vector"] == pytest.approx(0.1)
    assert mixed["period_ms"] == pytest.approx(1.0) and mixed["busy_ms"] == pytest.approx(0.35)
    assert mixed["families_ms"]["attn-prefill"] == pytest.approx(0.2)
    assert mixed["families_ms"]["lora-tiled"] == pytest.approx(0.1)
    assert mixed["families_ms"]["memcpy"] == pytest.approx(0.05)
    assert mixed["prefill_tokens"] == 300
    assert figures["side_ms"] == {"memcpy": pytest.approx(1.0)}
    assert figures["side_bytes"] == 64_000_000
    assert "| 1 | mixed | 5 | 300 | 3 (1.0) | 1.00 | 0.35 | 0.65 |" in table


def test_family_names_the_engine_kernels():
    assert family({"cat": "kernel", "name": "_shrink_reduce_kernel"}) == "lora-reduce"
    assert family({"cat": "kernel", "name": "_rms_norm_kernel"}) == "fused"
    assert family({"cat": "gpu_memset", "name": "Memset"}) == "memset"
    assert family({"cat": "kernel", "name": "void at::native::elementwise_kernel"}) == "other"
