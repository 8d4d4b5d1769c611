#!/usr/bin/env bash
# Everything the GPU must check and time, in one call of the device machine.
#   bash benchmarks/device_run.sh check   # gpu-marked tests, LoRA kernel timings, engine profile
#   bash benchmarks/device_run.sh sweep   # LoRA kernel variants, every GPU test, base and slora@1000, profiles
#   bash benchmarks/device_run.sh smoke   # a short bench on every system
#   bash benchmarks/device_run.sh final   # engine GPU tests, then the acceptance run, 18 s a run
#   bash benchmarks/device_run.sh verify  # every gpu test, then base, slora@1/10/1000/2000 and peft
#   bash benchmarks/device_run.sh quick   # engine gpu tests, then base and slora@1000 (~4 minutes)
#   bash benchmarks/device_run.sh few     # profiles of 10 adapters (grouped and arrival order) and 100
#   bash benchmarks/device_run.sh ten     # base, slora@10 grouped by adapter and in arrival order
#   bash benchmarks/device_run.sh tiles   # the tiled decode kernels' tokens per block and warps
#   bash benchmarks/device_run.sh close   # base, slora@1/10/1000/2000, peft, adapter-wait@1000/2000
#   bash benchmarks/device_run.sh steps   # device time per step kind at 0, 10 and 2000 adapters
#   bash benchmarks/device_run.sh knobs   # LoRA kernel GPU tests at both settings of "er", then the LoRA sweep
#   bash benchmarks/device_run.sh last    # engine gpu tests, then base, slora@10/100/1000/2000, peft, bmm, no-unified
#   bash benchmarks/device_run.sh probe   # the vector LoRA kernels at one rank and mixed ranks, then ncu
#   bash benchmarks/device_run.sh tests   # every gpu test (about 5 minutes on a fresh machine)
#   bash benchmarks/device_run.sh bench   # the DESIGN section 5 acceptance run (~9 minutes)
#   bash benchmarks/device_run.sh confirm # base, slora@10/1000/2000 and peft again, 25 s a run, profiles
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

gpu_tests() {  # gpu_tests SECONDS LINES PYTEST_ARGS...: the gpu-marked tests into gpu-tests.log
  local limit=$1 lines=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$out/gpu-tests.log" 2>&1
  tail -"$lines" "$out/gpu-tests.log"
}
bench() {  # bench DIR SECONDS LINES BENCH_ARGS...: slora-batch bench into $out/DIR
  local dir=$out/$1 limit=$2 lines=$3
  shift 3
  mkdir -p "$dir"
  timeout "$limit" python3 -m slora_batch.bench_cli "$@" --out "$dir" > "$dir/bench.log" 2>&1
  tail -"$lines" "$dir/bench.log"; cat "$dir/results.md" 2>/dev/null
}
profile() {  # profile SECONDS ADAPTER_COUNTS [ARGS...]: per-step times and top kernels
  local limit=$1 counts=$2
  shift 2
  timeout "$limit" python3 -m benchmarks.profile_engine --adapters "$counts" --requests 800 \
    --out "$out" "$@" >> "$out/profile.log" 2>&1
  grep -E "^adapters|profiled" "$out/profile.log"
}
# the acceptance workload (DESIGN section 5) with PEFT's one static batch of 64 rows
ACCEPTANCE=(--requests 2000 --peft-requests 64 --peft-batch 64)

if [ "$mode" = check ]; then
  # gpu-marked tests, LoRA kernel timings (eager and graph-replayed), a profile of the engine
  gpu_tests 220 15 --durations=10 tests/test_kernels_gpu.py tests/test_engine_gpu.py
  timeout 200 python3 -m benchmarks.kernels --quick --lora-only --decode-sweep > "$out/kernels-bench.md" 2>&1
  cat "$out/kernels-bench.md"
  profile 110 1000
elif [ "$mode" = sweep ]; then
  # LoRA kernel variants, every gpu test, base and slora@1000, profiles of both
  timeout 170 python3 -m benchmarks.kernels --vector-sweep > "$out/vector-sweep.md" 2>&1
  cat "$out/vector-sweep.md"
  gpu_tests 240 8 --durations=5 tests/test_kernels_gpu.py tests/test_engine_gpu.py
  bench h200 110 6 --requests 2000 --systems base,slora --adapters 1000 --max-seconds 18 \
    --total-seconds 100
  profile 100 1000,0
elif [ "$mode" = smoke ]; then
  bench smoke 200 25 --systems base,slora,peft,bmm,no-unified --adapters 10 --peft-adapters 2 \
    --requests 300 --max-input 256 --max-output 64 --max-seconds 4 --warmup-requests 8 \
    --peft-requests 8 --peft-batch 8 --peft-max-seconds 10 --total-seconds 150
elif [ "$mode" = final ]; then
  # the engine against transformers + PEFT and the kernel paths it uses, then the acceptance run
  gpu_tests 150 15 tests/test_engine_gpu.py tests/test_kernels_gpu.py \
    -k "engine or paths or cuda_graph or attention_prefill"
  bench h200 420 12 "${ACCEPTANCE[@]}" --systems base,slora,peft,bmm,no-unified \
    --adapters 1,10,100,1000,2000 --ablation-adapters 1000 --peft-adapters 1 --max-seconds 18 \
    --peft-max-seconds 90 --total-seconds 400
elif [ "$mode" = verify ]; then
  gpu_tests 300 14 --durations=8 tests/test_engine_gpu.py tests/test_kernels_gpu.py
  bench h200 260 12 "${ACCEPTANCE[@]}" --systems base,slora,peft --adapters 1,10,1000,2000 \
    --peft-adapters 1 --max-seconds 18 --peft-max-seconds 90 --total-seconds 250
elif [ "$mode" = quick ]; then
  gpu_tests 140 4 tests/test_engine_gpu.py
  bench h200 110 6 --requests 2000 --systems base,slora --adapters 1000 --max-seconds 18 \
    --total-seconds 100
elif [ "$mode" = confirm ]; then
  # a second acceptance run of the ratios (base, slora@10/1000/2000, peft), then profiles of
  # base and slora@2000 (per-step times and top kernels)
  bench h200-confirm 340 12 "${ACCEPTANCE[@]}" --systems base,slora,peft --adapters 10,1000,2000 \
    --peft-adapters 1 --max-seconds 25 --peft-max-seconds 150 --total-seconds 330
  profile 90 2000,0
elif [ "$mode" = few ]; then
  # where a step's time goes at 10 adapters, requests grouped by adapter (the bench's order) and
  # in arrival order, next to 100 adapters
  profile 150 10,100 --profile-steps 16 --rows 30
  profile 80 10 --order arrival --profile-steps 16 --rows 30
elif [ "$mode" = ten ]; then
  # base, then slora@10 with the workload grouped by adapter and in arrival order, side by side
  gpu_tests 90 3 tests/test_builds.py
  bench h200-ten 200 8 --requests 2000 --systems base,slora,arrival --adapters 10 \
    --max-seconds 25 --total-seconds 190
elif [ "$mode" = tiles ]; then
  # the tiled LoRA kernels of decode steps on few adapters, tokens per block and warps varied
  timeout 400 python3 -m benchmarks.kernels --tiled-sweep > "$out/tiled-sweep.md" 2>&1
  cat "$out/tiled-sweep.md"
elif [ "$mode" = close ]; then
  # the acceptance ratios (base, slora@1/10/1000/2000, peft) at 25 s a run, and adapter-wait
  # (prefetch_wait "adapter") at 1000 and 2000 beside them
  bench h200-close 420 14 "${ACCEPTANCE[@]}" --systems base,slora,peft,adapter-wait \
    --adapters 1,10,1000,2000 --ablation-adapters 1000,2000 --peft-adapters 1 --max-seconds 25 \
    --peft-max-seconds 90 --total-seconds 410
elif [ "$mode" = steps ]; then
  # each step's device time by kernel family and the GPU's idle time, decode and mixed steps
  # apart, at 0, 10 and 2000 adapters (where slora@2000 loses to slora@10), on the bench's
  # 2000 requests (800 put 212 distinct adapters in a 2000-adapter decode step, the bench 188)
  profile 330 0,10,2000 --requests 2000 --profile-steps 90 --rows 25 --trace
  cat "$out"/steps-*.md
elif [ "$mode" = knobs ]; then
  # the LoRA kernels against their twins at both settings of the tiled expand's "er" knob, then
  # the LoRA kernels' variants timed: decode steps on 2000 and 1000 adapters, a mixed step
  gpu_tests 150 6 tests/test_kernels_gpu.py -k "lora or cuda_graph"
  timeout 300 python3 -m benchmarks.kernels --vector-sweep > "$out/vector-sweep.md" 2>&1
  cat "$out/vector-sweep.md"
elif [ "$mode" = last ]; then
  # what a change of the kernels' defaults needs once the kernel tests passed at both settings:
  # the engine against transformers + PEFT, then every acceptance figure at 20 s a run
  gpu_tests 240 6 --durations=5 tests/test_engine_gpu.py tests/test_builds.py
  bench h200 330 16 "${ACCEPTANCE[@]}" --systems base,slora,peft,bmm,no-unified \
    --adapters 10,100,1000,2000 --ablation-adapters 1000 --peft-adapters 1 --max-seconds 20 \
    --peft-max-seconds 90 --total-seconds 320
elif [ "$mode" = probe ]; then
  # why the vector kernels of a 2000-adapter decode step move rows at ~0.65 of the copy bandwidth
  # (python3 -m benchmarks.vector_probe --no-ncu: the timings only)
  timeout 250 python3 -m benchmarks.vector_probe --out "$out" > "$out/probe.md" 2>&1
  cat "$out/probe.md"
elif [ "$mode" = tests ]; then
  # every gpu test; 230 s cut the d243031 run after 60 passed, so this one has 540 s
  gpu_tests 540 20 --durations=10 tests/test_engine_gpu.py tests/test_kernels_gpu.py \
    tests/test_builds.py
elif [ "$mode" = bench ]; then
  bench h200 580 16 "${ACCEPTANCE[@]}" --systems base,slora,peft,bmm,no-unified,arrival,adapter-wait \
    --adapters 1,10,100,1000,2000 --ablation-adapters 1000 --peft-adapters 1 --max-seconds 25 \
    --peft-max-seconds 150 --total-seconds 545
fi
