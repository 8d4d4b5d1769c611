#!/usr/bin/env bash
# Everything the GPU checks and times, one mode per device call (each fits the 600 s limit):
#   bash benchmarks/device_run.sh tests [kernels|engine]  # the GPU tests (all: on 4 workers)
#   bash benchmarks/device_run.sh bench    # the acceptance run, 20 s a run (~8 minutes)
#   bash benchmarks/device_run.sh profile  # device time per step kind and kernel family at 0, 10, 2000
#   bash benchmarks/device_run.sh kernels  # LoRA and attention kernel timings, then the LoRA sweep
#   bash benchmarks/device_run.sh now EXP  # the current experiment EXP: json, eval, fp8(-tests), batch(-7b,-profile),
#                                          # families(-tests), job, rooms, prefix, score, tp, dp-job
# Writes logs and results under $OUT (or ./out/device when OUT is unset); copy the acceptance
# run to benchmarks/results/<card>/ and commit it.
set -uo pipefail
mode=${1:-tests}
out=${OUT:-out/device}
mkdir -p "$out"
# the kernels import as slora_kernels (pyproject's package-dir): an editable install, offline, with
# the image's own setuptools; where that fails, a link named slora_kernels on the path
if ! python3 -c "import slora_kernels" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/slora-install.log 2>&1 \
    || { mkdir -p /tmp/slora-path && ln -sfn "$PWD/kernels" /tmp/slora-path/slora_kernels; }
fi
export PYTHONPATH=$PWD:/tmp/slora-path PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export SLORA_BATCH_COMMIT=${SLORA_BATCH_COMMIT:-$(cat benchmarks/.commit 2>/dev/null || echo unknown)}
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$out/env.log"

gpu_tests() {  # gpu_tests SECONDS PYTEST_ARGS...: the gpu-marked tests into gpu-tests.log
  local limit=$1
  shift
  timeout "$limit" python3 -m pytest -q -m gpu -o addopts= -p no:cacheprovider "$@" > "$out/gpu-tests.log" 2>&1
  tail -25 "$out/gpu-tests.log"
}
bench() {  # bench DIR SECONDS BENCH_ARGS...: slora-batch bench into $out/DIR
  local dir=$out/$1 limit=$2
  shift 2
  mkdir -p "$dir"
  timeout "$limit" python3 -m slora_batch.bench.cli "$@" --out "$dir" > "$dir/bench.log" 2>&1
  tail -5 "$dir/bench.log"; cat "$dir/results.md" 2>/dev/null
}
# the acceptance workload (benchmarks/README.md) with PEFT's one static batch of 64 rows
ACCEPTANCE=(--requests 2000 --peft-requests 64 --peft-batch 64 --peft-adapters 1 --peft-max-seconds 150)

case "$mode" in
  tests)
    # every GPU test in one call: on 4 xdist workers (Triton's builds take most of a serial
    # run; 8 ran an H100 out of memory), a GPU model's tests on one worker (tests/conftest.py),
    # then alone the tests that read the card's free memory or a step's overlap, or take
    # gigabytes, which other workers would upset (the fp8 KV engines beside fp32 PEFT at the
    # 7B shape: 63 GiB, out of memory on an 80 GB H100 beside three workers)
    # ("tests kernels" / "tests engine": the halves, serially, as before)
    case "${2:-all}" in
      kernels) gpu_tests 580 --durations=10 --maxfail=10 tests/kernels ;;
      engine) gpu_tests ${TESTS_LIMIT:-580} --durations=10 --maxfail=10 tests/engine ;;
      *)
        alone="whole_pool or test_host_copies or past_2_31 or widened_ties or test_shared_process"
        gpu_tests ${TESTS_LIMIT:-420} --durations=15 -n 4 --dist loadgroup tests/kernels \
          tests/engine -k "not ($alone)"
        mv "$out/gpu-tests.log" "$out/gpu-tests-workers.log"
        gpu_tests 240 --durations=5 tests/kernels tests/engine -k "$alone"
        mv "$out/gpu-tests.log" "$out/gpu-tests-alone.log"
        cat "$out/gpu-tests-workers.log" "$out/gpu-tests-alone.log" > "$out/gpu-tests.log"
        ;;
    esac
    cp "$out/gpu-tests.log" "$out/gpu-tests-${2:-all}.log"
    ;;
  bench)
    bench h200 590 "${ACCEPTANCE[@]}" --systems base,slora,peft,bmm,no-unified,arrival \
      --adapters 1,10,100,1000,2000 --ablation-adapters 1000 --max-seconds 20 --total-seconds 560
    ;;
  profile)
    timeout 560 python3 -m benchmarks.profile_engine --adapters 0,10,2000 --requests 2000 \
      --profile-steps 90 --rows 25 --trace --out "$out" > "$out/profile.log" 2>&1
    grep -E "^adapters|profiled" "$out/profile.log"; cat "$out"/steps-*.md
    ;;
  kernels)
    timeout 200 python3 -m benchmarks.kernels --quick --decode-sweep > "$out/kernels.md" 2>&1
    timeout 170 python3 -m benchmarks.kernels --vector-sweep > "$out/vector-sweep.md" 2>&1
    timeout 200 python3 -m benchmarks.kernels --tiled-sweep > "$out/tiled-sweep.md" 2>&1
    cat "$out/kernels.md" "$out/vector-sweep.md" "$out/tiled-sweep.md"
    ;;
  now)
    # the current experiments, one per call, each into $out/<its name>/
    case "${2:-}" in
      job)
        # issue 16's job system: 4000 rows at 1000 adapters through the real job path (model
        # and adapter directories on disk, Parquet in and out) beside the in-process engine on
        # the same requests, both uncut
        bench job 580 --requests 4000 --systems slora,job --adapters 1000 --max-seconds 0 \
          --total-seconds 0
        ;;
      rooms)
        # issue 25 (the engine in rooms, no behaviour change): base and slora@1000 as the
        # acceptance run measures them (20 s cuts), to compare with results/h200
        bench rooms 300 "${ACCEPTANCE[@]}" --systems base,slora --adapters 1000 \
          --max-seconds 20 --total-seconds 280
        ;;
      families-tests)
        # issue 26's GPU checks: every kernel test (windows, soft-caps, head_dim 256, GeGLU, fused
        # B) and the bf16 engine against transformers + PEFT on every shape, families included
        gpu_tests 590 --durations=15 --maxfail=10 tests/kernels tests/engine/test_engine_gpu.py
        ;;
      families-fix)
        # issue 26 after the first families-tests: Gemma's graphs again, then the three presets
        # with 15 s cuts, in one call
        gpu_tests 150 tests/engine/test_engine_gpu.py -k "gemma and (matches_peft or tiled)"
        for preset in llama3-8b qwen3-8b gemma2-9b; do
          bench "families/$preset" 140 --model-preset "$preset" --requests 2000 \
            --systems base,slora --adapters 1000 --max-seconds 15 --total-seconds 125
        done
        ;;
      families)
        # issue 26: base and slora@1000 on the standard workload for the families users fine-tune,
        # 20 s cuts, one bench per preset (llama2-7b is in results/h200)
        for preset in llama3-8b qwen3-8b gemma2-9b; do
          bench "families/$preset" 190 --model-preset "$preset" --requests 2000 \
            --systems base,slora --adapters 1000 --max-seconds 20 --total-seconds 170
        done
        ;;
      prefix)
        # the prefix-cache issue, side by side at 50 adapters, 45 s cuts: slora and slora-off
        # (the standard workload, no sharing); prefix and prefix-off (4000 rows, a 1024-token
        # prefix per adapter, suffixes 32-128, 64 output tokens); samples (500 prompts, n = 8)
        # and samples-separate (eight requests of each)
        bench prefix 590 --systems slora,slora-off,prefix,prefix-off,samples,samples-separate \
          --adapters 50 --requests 2000 --prefix-rows 4000 --prefix-tokens 1024 \
          --prefix-min-suffix 32 --prefix-max-suffix 128 --prefix-output 64 \
          --samples-prompts 500 --samples-n 8 --max-seconds 45 --total-seconds 560
        ;;
      score)
        # the scoring issue: score at 1000 adapters against peft-score at 1 and 100, 120 s each
        bench score 590 --systems score,peft-score --adapters 1000 --peft-adapters 1,100 \
          --max-seconds 120 --peft-max-seconds 120 --total-seconds 560
        ;;
      tp)
        # two GPUs: base and slora on one device beside base-par and slora-par at tensor
        # parallel 2, then at data parallel 2 (7B, 1000 adapters, 15 s cuts); then the 70B
        # preset at tensor parallel 2 (no card holds it alone), 100 adapters. The three
        # share the call: 180 + 180 + 200 s at most
        python3 -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)" \
          || { echo "now tp needs two GPUs (the nvidia-h200-x2 kind)" >&2; exit 2; }
        bench tp/tp2-7b 180 --tensor-parallel 2 --adapters 1000 --max-seconds 15 \
          --total-seconds 160
        bench tp/dp2-7b 180 --data-parallel 2 --adapters 1000 --max-seconds 15 \
          --total-seconds 160
        bench tp/tp2-70b 200 --model-preset llama2-70b --tensor-parallel 2 \
          --systems base-par,slora-par --adapters 100 --max-seconds 20 --total-seconds 180
        ;;
      dp-job)
        # two GPUs: the bf16 TP=2 parity test (into gpu-tests.log), then issue 16's job point at
        # data parallel 2: the job path (job-par) beside the in-process engines (slora-par) on
        # the same 4000 requests at 1000 adapters, uncut
        python3 -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)" \
          || { echo "now dp-job needs two GPUs (the nvidia-h200-x2 kind)" >&2; exit 2; }
        gpu_tests 150 tests/engine/execution/test_tensor_parallel_gpu.py
        bench tp/dp2-job 420 --data-parallel 2 --requests 4000 --systems slora-par,job-par \
          --adapters 1000 --max-seconds 0 --total-seconds 0
        ;;
      fp8)
        # issue 28's fp8 points, uncut, one card: Llama-2-7B slora@1000 with fp8 KV against bf16
        # KV (>= 1.4x), then Llama-3-8B base with fp8 weights + fp8 KV against bf16 (>= 1.35x),
        # both at max_num_seqs auto; then the fp8 GPU tests
        for kv in auto fp8; do
          bench "fp8/llama2-7b-kv-$kv" 150 --requests 2000 --systems slora --adapters 1000 \
            --kv-cache-dtype "$kv" --max-seconds 0 --total-seconds 0
        done
        bench fp8/llama3-8b-bf16 120 --model-preset llama3-8b --requests 2000 --systems base \
          --max-seconds 0 --total-seconds 0
        bench fp8/llama3-8b-fp8 120 --model-preset llama3-8b --requests 2000 --systems base \
          --weights fp8 --kv-cache-dtype fp8 --max-seconds 0 --total-seconds 0
        ;;
      fp8-kernels)
        # issue 28: decode / prefill attention on fp8 pages against bf16 pages and the decode
        # tile variants on fp8 (benchmarks/fp8_kernels.py), then Llama-2-7B slora@1000 uncut
        # with bf16 KV, fp8 KV, and fp8 KV with the adapter cap at 512 (fp8 seats 2x the rows)
        timeout 150 python3 -m benchmarks.fp8_kernels > "$out/fp8-kernels.md" 2>&1
        cat "$out/fp8-kernels.md"
        for kv in auto fp8; do
          bench "fp8/llama2-7b-kv-$kv" 130 --requests 2000 --systems slora --adapters 1000 \
            --kv-cache-dtype "$kv" --max-seconds 0 --total-seconds 0
        done
        bench fp8/llama2-7b-kv-fp8-cap512 130 --requests 2000 --systems slora --adapters 1000 \
          --kv-cache-dtype fp8 --max-adapters-per-batch 512 --max-seconds 0 --total-seconds 0
        ;;
      fp8-next)
        # issue 28 after fp8-kernels: the fp8 GPU tests (fp16 dots on fp8 pages), then
        # Llama-3-8B base with fp8 weights + fp8 KV against bf16, uncut, max_num_seqs auto
        gpu_tests 280 tests/kernels/test_attention_fp8_gpu.py tests/engine/test_fp8_kv_gpu.py \
          tests/kernels/test_kernels_gpu.py -k "fp8"
        bench fp8/llama3-8b-bf16 120 --model-preset llama3-8b --requests 2000 --systems base \
          --max-seconds 0 --total-seconds 0
        bench fp8/llama3-8b-fp8 120 --model-preset llama3-8b --requests 2000 --systems base \
          --weights fp8 --kv-cache-dtype fp8 --max-seconds 0 --total-seconds 0
        ;;
      fp8-w)
        # issue 28, the fused activation quantizer: its GPU test and the fp8 weight tests, then
        # Llama-3-8B base bf16 against fp8 weights + fp8 KV, uncut, max_num_seqs auto
        gpu_tests 120 tests/kernels/test_kernels_gpu.py tests/engine/models -k "act_quant or fp8"
        bench fp8/llama3-8b-bf16 110 --model-preset llama3-8b --requests 2000 --systems base \
          --max-seconds 0 --total-seconds 0
        bench fp8/llama3-8b-fp8 110 --model-preset llama3-8b --requests 2000 --systems base \
          --weights fp8 --kv-cache-dtype fp8 --max-seconds 0 --total-seconds 0
        ;;
      fp8-v)
        # issue 28: the quick fp8 kernel table, the fp8 kernel GPU tests and the activation
        # quantizer's, then Llama-2-7B slora@1000 uncut with fp8 KV (bf16 KV: now fp8-kernels)
        timeout 60 python3 -m benchmarks.fp8_kernels --quick 2>&1 | tee "$out/fp8-kernels.md"
        gpu_tests 70 tests/kernels/test_attention_fp8_gpu.py tests/kernels/test_kernels_gpu.py \
          -k "fp8 or act_quant"
        bench fp8/llama2-7b-kv-fp8 110 --requests 2000 --systems slora --adapters 1000 \
          --kv-cache-dtype fp8 --max-seconds 0 --total-seconds 0
        ;;
      fp8-tests)
        # the fp8 KV kernels and engine, and fp8 weights, on the card (issue 28)
        gpu_tests 590 tests/kernels/test_attention_fp8_gpu.py tests/engine/test_fp8_kv_gpu.py \
          tests/kernels/test_kernels_gpu.py -k "fp8"
        ;;
      json)
        # issue 27: xgrammar travels as wheels (wheels/, carried); json (the
        # standard requests under a schema) at 1000 adapters, uncut, against json-free (the same
        # requests unconstrained at the lengths json produced): the constraint's price per token
        python3 -m pip install -q --no-index --find-links wheels xgrammar \
          || { echo "now json: install xgrammar from wheels/ (carry it)" >&2; exit 2; }
        bench json 590 --requests 2000 --systems json,json-free --adapters 1000 --max-seconds 0 \
          --total-seconds 560
        ;;
      eval)
        # issue 29: the lm-eval sweep (lm-eval and its missing dependencies travel in wheels/,
        # carried, with the sample model's tokenizer in wheels/smollm2-tokenizer) of a
        # 7B-shaped model over 100 adapters and the base on a 48-document multiple-choice task,
        # beside the engine alone on the same rows (eval-score), uncut
        # (each wheel as it is, no resolution: the image's own pyarrow, fsspec and hub stay)
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
          wheels/*.whl || { echo "now eval: install lm-eval from wheels/ (carry it)" >&2; exit 2; }
        export PYTHONPATH=$PYTHONPATH:/tmp/site
        bench eval "${EVAL_LIMIT:-450}" --systems eval-score,eval --adapters 100 \
          --tokenizer wheels/smollm2-tokenizer --eval-docs 48 --max-seconds 0 --total-seconds 0
        ;;
      batch-profile)
        # issue 37's shortfalls on Llama-3-8B shapes at auto: where base's step time goes past
        # its floor and what slora@1000 adds (steps by kind and kernels, torch.profiler), then
        # slora@1000 with a 512-adapter cap (the 256 cap holds its decode batch at ~350 rows)
        timeout 330 python3 -m benchmarks.profile_engine --preset llama3-8b --adapters 0,1000 \
          --requests 2000 --profile-steps 60 --trace --out "$out/profile37" \
          > "$out/profile37.log" 2>&1
        grep -E "^adapters|profiled" "$out/profile37.log"; cat "$out"/profile37/steps-*.md
        bench batch/llama3-8b-auto-cap512 150 --model-preset llama3-8b --requests 2000 \
          --systems slora --adapters 1000 --max-adapters-per-batch 512 --max-seconds 0 \
          --total-seconds 0
        ;;
      batch)
        # issue 37 on Llama-3-8B shapes, uncut: base and slora@1000 at a 256-row cap and at
        # auto (auto must never be slower; slora >= 0.85 of base at auto; base's floor
        # fraction >= 0.8), then slora@1000 at 512 rows (decode host share < 10%)
        for seqs in 256 auto; do
          bench "batch/llama3-8b-$seqs" 200 --model-preset llama3-8b --requests 2000 \
            --systems base,slora --adapters 1000 --max-num-seqs "$seqs" --max-seconds 0 \
            --total-seconds 0
        done
        bench batch/llama3-8b-512 150 --model-preset llama3-8b --requests 2000 --systems slora \
          --adapters 1000 --max-num-seqs 512 --max-seconds 0 --total-seconds 0
        ;;
      batch-7b)
        # issue 37 on Llama-2-7B shapes (its KV is 4x wider), uncut: slora@1000 at 512 rows
        # (decode host share < 10%), then base and slora@1000 at auto (base's floor fraction)
        bench batch/llama2-7b-512 200 --requests 2000 --systems slora --adapters 1000 \
          --max-num-seqs 512 --max-seconds 0 --total-seconds 0
        bench batch/llama2-7b-auto 220 --requests 2000 --systems base,slora --adapters 1000 \
          --max-seconds 0 --total-seconds 0
        ;;
      *)
        echo "now needs an experiment: json, eval, fp8, fp8-kernels, fp8-tests, batch, batch-7b, families, families-tests, job, rooms, prefix, score, tp or dp-job (got '${2:-}')" >&2
        exit 2
        ;;
    esac
    ;;
  *)
    echo "unknown mode $mode (tests, bench, profile, kernels, now)" >&2
    exit 2
    ;;
esac
