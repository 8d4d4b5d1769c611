#!/usr/bin/env bash
# Everything the GPU must check and time, in one call of the device machine.
#   bash benchmarks/device_run.sh check   # gpu-marked tests, LoRA kernel timings, engine profile
#   bash benchmarks/device_run.sh sweep   # LoRA kernel variants (decode and mixed steps), GPU tests, profiles
#   bash benchmarks/device_run.sh smoke   # a short bench on every system
#   bash benchmarks/device_run.sh final   # engine GPU tests, then the acceptance run, 18 s a run
#   bash benchmarks/device_run.sh verify  # every gpu test, then base, slora@10/1000/2000 and peft
#   bash benchmarks/device_run.sh quick   # engine gpu tests, then base and slora@1000 (~4 minutes)
#   bash benchmarks/device_run.sh bench   # the DESIGN section 5 acceptance run (~9 minutes)
# Writes logs and results under $OUT (or ./out/device when OUT is unset).
set -uo pipefail
mode=${1:-check}
out=${OUT:-out/device}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export SLORA_BATCH_COMMIT=${SLORA_BATCH_COMMIT:-$(cat benchmarks/.commit 2>/dev/null || echo unknown)}
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$out/env.log"

if [ "$mode" = check ]; then
  # gpu-marked tests, LoRA kernel timings (eager and graph-replayed), a profile of the engine
  timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/test_kernels_gpu.py \
    tests/test_engine_gpu.py > "$out/gpu-tests.log" 2>&1
  tail -15 "$out/gpu-tests.log"
  timeout 200 python3 -m benchmarks.kernels --quick --lora-only --decode-sweep > "$out/kernels-bench.md" 2>&1
  cat "$out/kernels-bench.md"
  timeout 110 python3 -m benchmarks.profile_engine --adapters 1000 --requests 800 --out "$out" \
    > "$out/profile.log" 2>&1
  grep -E "^adapters|profiled" "$out/profile.log"
elif [ "$mode" = sweep ]; then
  timeout 260 python3 -m benchmarks.kernels --vector-sweep > "$out/vector-sweep.md" 2>&1
  cat "$out/vector-sweep.md"
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "lora_paths or cuda_graph" > "$out/gpu-tests.log" 2>&1
  tail -5 "$out/gpu-tests.log"
  timeout 170 python3 -m benchmarks.profile_engine --adapters 1000,0 --requests 800 --out "$out" \
    > "$out/profile.log" 2>&1
  grep -E "^adapters|profiled" "$out/profile.log"
elif [ "$mode" = smoke ]; then
  mkdir -p "$out/smoke"
  timeout 200 python3 -m slora_batch.bench_cli --systems base,slora,peft,bmm,no-unified --adapters 10 \
    --peft-adapters 2 --requests 300 --max-input 256 --max-output 64 --max-seconds 4 --warmup-requests 8 \
    --peft-requests 8 --peft-batch 8 --peft-max-seconds 10 --total-seconds 150 --out "$out/smoke" \
    > "$out/smoke/bench.log" 2>&1
  tail -25 "$out/smoke/bench.log"; cat "$out/smoke/results.md" 2>/dev/null
elif [ "$mode" = final ]; then
  # the engine against transformers + PEFT and the kernel paths it uses, then the acceptance run
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py \
    tests/test_kernels_gpu.py -k "engine or paths or cuda_graph or attention_prefill" \
    > "$out/gpu-tests.log" 2>&1
  tail -15 "$out/gpu-tests.log"
  mkdir -p "$out/h200"
  timeout 420 python3 -m slora_batch.bench_cli --systems base,slora,peft,bmm,no-unified \
    --adapters 1,10,100,1000,2000 --ablation-adapters 1000 --peft-adapters 1 --requests 2000 \
    --max-seconds 18 --peft-requests 64 --peft-batch 64 --peft-max-seconds 90 --total-seconds 400 \
    --out "$out/h200" > "$out/h200/bench.log" 2>&1
  tail -12 "$out/h200/bench.log"; cat "$out/h200/results.md" 2>/dev/null
elif [ "$mode" = verify ]; then
  timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_engine_gpu.py \
    tests/test_kernels_gpu.py > "$out/gpu-tests.log" 2>&1
  tail -14 "$out/gpu-tests.log"
  mkdir -p "$out/h200"
  timeout 300 python3 -m slora_batch.bench_cli --systems base,slora,peft --adapters 10,1000,2000 \
    --peft-adapters 1 --requests 2000 --max-seconds 18 --peft-requests 64 --peft-batch 64 \
    --peft-max-seconds 90 --total-seconds 290 --out "$out/h200" > "$out/h200/bench.log" 2>&1
  tail -12 "$out/h200/bench.log"; cat "$out/h200/results.md" 2>/dev/null
elif [ "$mode" = quick ]; then
  timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py \
    > "$out/gpu-tests.log" 2>&1
  tail -4 "$out/gpu-tests.log"
  mkdir -p "$out/h200"
  timeout 110 python3 -m slora_batch.bench_cli --systems base,slora --adapters 1000 \
    --requests 2000 --max-seconds 18 --total-seconds 100 --out "$out/h200" \
    > "$out/h200/bench.log" 2>&1
  tail -6 "$out/h200/bench.log"; cat "$out/h200/results.md" 2>/dev/null
elif [ "$mode" = bench ]; then
  mkdir -p "$out/h200"
  timeout 570 python3 -m slora_batch.bench_cli --systems base,slora,peft,bmm,no-unified \
    --adapters 1,10,100,1000,2000 --ablation-adapters 1000 --peft-adapters 1 --requests 2000 \
    --max-seconds 25 --peft-requests 64 --peft-batch 64 --peft-max-seconds 150 --total-seconds 520 \
    --out "$out/h200" > "$out/h200/bench.log" 2>&1
  tail -15 "$out/h200/bench.log"; cat "$out/h200/results.md" 2>/dev/null
fi
