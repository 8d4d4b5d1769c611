#!/usr/bin/env bash
# The GPU tests and benchmarks: bash benchmarks/device_run.sh MODE [PART], one mode per device call
# (each fits the device's 600 s limit), from the repository root with the image's python3:
#   tests [kernels|engine|fp8]  every GPU test on 4 workers, failures rerun alone; or one half,
#                      serially; fp8: the fp8 attention, fp8 KV, fp8 adapter and LoRA kernel tests  ~5 min
#   bench [prefix|score|json|tp|dora|fp8a|lora]  the acceptance workload; or a feature's workload beside its baseline  ~10 min
#   profile [PRESET]   device time per step kind and kernel family on llama2-7b (or PRESET)  ~6 min
#   kernels            LoRA and attention kernel timings, then the LoRA kernel variant sweeps  ~8 min
#   fp8 [slora|kv]     bf16 against fp8 KV and fp8 weights + KV, engine uncut; fp8 attention kernels  ~9 min
#                      (slora: llama3-8b slora@1000, bf16 against fp8 weights + KV; kv: the kernels and
#                      llama2-7b slora@1000, bf16 against fp8 KV, ~5 min)
#   families [PRESET]  base and slora@1000 on llama3-8b, qwen3-8b, gemma2-9b, 15 s cuts; PRESET: uncut  ~8 min
#   moe                qwen3-30b-a3b: base beside slora@1000 on attention, then beside slora@100 on the
#                      experts, each pair in one bench process, 45 s cuts  ~9 min
#   job [dp]           the job path (slora-batch run) against the in-process engine, 4000 rows, uncut  ~5 min
#   eval               the lm-eval sweep (100 adapters and the base) against the engine on its rows  ~4 min
# bench json and eval install from wheels/ (carry it); bench tp and job dp need two GPUs.
# Results go to $OUT/<mode>/ (./out/device/<mode>/ when OUT is unset; a PART: $OUT/<mode>/<PART>/),
# logs and env.log included. The last line names the card (h100, h200, ...): copy $OUT/<mode>/ to
# benchmarks/results/<card>/<mode>/ and commit it. Where the copy has no .git, pass the commit as
# SLORA_BATCH_COMMIT=<sha> (or write it to benchmarks/.commit).
set -uo pipefail
mode=${1:-}
part=${2:-}
status=0 # set to 1 by a step that fails; the script's exit status

usage() { # the header above, as the usage text
  sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0" >&2
  exit 2
}

case "$mode:$part" in # the modes and the parts each takes (profile and families: a preset)
  tests: | tests:kernels | tests:engine | tests:fp8 | bench: | bench:prefix | bench:score | bench:json | bench:tp) ;;
  bench:dora | bench:fp8a | bench:lora) ;;
  profile:* | kernels: | fp8: | fp8:slora | fp8:kv | families:* | moe: | job: | job:dp | eval:) ;;
  *) usage ;;
esac
dir=${OUT:-out/device}/$mode${part:+/$part}
mkdir -p "$dir"

card_name() { # the first GPU's model in lower case (NVIDIA H100 80GB HBM3 -> h100), else its name
  local name short
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  short=$(grep -oiE '\b[a-z]+[0-9]+[a-z]*' <<< "${name#NVIDIA }" | head -1)
  [ -n "$short" ] || short=$(tr -cs '[:alnum:]' '-' <<< "${name:-unknown}" | sed 's/^-//; s/-$//')
  tr '[:upper:]' '[:lower:]' <<< "$short"
}

# the kernels import as slora_kernels (pyproject's package-dir): an editable install, offline, with
# the image's own setuptools; where that fails, a link named slora_kernels on the path
if ! python3 -c "import slora_kernels" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    > /tmp/slora-install.log 2>&1 || { mkdir -p /tmp/slora-path && ln -sfn "$PWD/kernels" /tmp/slora-path/slora_kernels; }
fi
export PYTHONPATH=$PWD:/tmp/slora-path PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export SLORA_BATCH_COMMIT=${SLORA_BATCH_COMMIT:-$(cat benchmarks/.commit 2>/dev/null || echo unknown)}
card=$(card_name)
{
  echo "device_run.sh $mode${part:+ $part} at $SLORA_BATCH_COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import torch, triton, transformers, peft
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$dir/env.log"

need_gpus() { # need_gpus N: stop unless the machine has N GPUs
  python3 -c "import sys, torch; sys.exit(torch.cuda.device_count() < $1)" \
    || { echo "$mode $part needs $1 GPUs (a kind with $1 cards)" >&2; exit 2; }
}
bench() { # bench DIR SECONDS BENCH_ARGS...: slora-batch bench into DIR
  local out=$1 limit=$2
  shift 2
  mkdir -p "$out"
  timeout "$limit" python3 -m slora_batch.bench.cli "$@" --out "$out" > "$out/bench.log" 2>&1 \
    || status=1
  tail -5 "$out/bench.log"
  cat "$out/results.md" 2>/dev/null
}

# --- tests ---------------------------------------------------------------------------------------
deadline=${TESTS_BUDGET:-570} # seconds since the script started, install and env.log included
left() { # left MAX: seconds to give the next step, at most MAX, never past the deadline (>= 1)
  local remaining=$((deadline - SECONDS))
  remaining=$((remaining < $1 ? remaining : $1))
  echo $((remaining < 1 ? 1 : remaining))
}
gpu_tests() { # gpu_tests LOG SECONDS PYTEST_ARGS...: gpu-marked tests into $dir/LOG; pytest's status
  local log=$dir/$1 limit=$2 rc
  shift 2
  # SIGINT at the limit: pytest stops as on Ctrl-C and still writes its summary of failures
  timeout -s INT -k 30 "$limit" python3 -m pytest -q -m gpu -o addopts= -p no:cacheprovider "$@" \
    > "$log" 2>&1
  rc=$?
  tail -25 "$log"
  return $rc
}
failed_tests() { # failed_tests LOG: the node ids pytest's summary in LOG names as FAILED or ERROR
  sed -nE 's/^(FAILED|ERROR) ([^ ]+).*/\2/p' "$1" | sort -u
}
rerun_alone() { # rerun_alone LOG: each test that failed in LOG again, alone and serially
  local log=$dir/gpu-tests-rerun.log failed=0 id rc ids
  : > "$log"
  mapfile -t ids < <(failed_tests "$dir/$1")
  echo "rerun alone, serially: ${#ids[@]} tests that failed in $1" | tee -a "$log"
  for id in "${ids[@]}"; do
    if [ "$(left 180)" -lt 30 ]; then
      echo "rerun $id: not run (no time left)" | tee -a "$log"
      failed=1
      continue
    fi
    timeout -s INT -k 30 "$(left 180)" python3 -m pytest -q -m gpu -o addopts= -p no:cacheprovider \
      "$id" < /dev/null > "$dir/rerun-one.log" 2>&1
    rc=$?
    cat "$dir/rerun-one.log" >> "$log"
    if [ "$rc" -eq 0 ]; then
      echo "rerun $id: passed alone" | tee -a "$log"
    else
      echo "rerun $id: FAILED alone too (pytest status $rc)" | tee -a "$log"
      failed=1
    fi
  done
  rm -f "$dir/rerun-one.log"
  return $failed
}
mode_tests() {
  case "$part" in
    kernels | engine) # one half, serially
      gpu_tests "gpu-tests-$part.log" "$(left "${TESTS_LIMIT:-560}")" --durations=10 --maxfail=10 \
        "tests/$part" || status=1
      ;;
    fp8) # the kernels and engine paths fp8 pages and the decode LoRA kernels take, on 4 workers
      gpu_tests gpu-tests-fp8.log "$(left "${TESTS_LIMIT:-300}")" --durations=10 -n 4 \
        --dist loadgroup tests/kernels/test_attention_fp8_gpu.py tests/engine/test_fp8_kv_gpu.py \
        tests/kernels/test_kernels_gpu.py tests/kernels/test_fp8_adapters_gpu.py || status=1
      ;;
    "")
      # On 4 xdist workers (Triton's builds take most of a serial run; 8 ran an H100 out of
      # memory), a GPU model's tests on one worker (tests/conftest.py); then alone the tests that
      # read the card's free memory or a step's overlap, or take gigabytes, which other workers
      # would upset (the fp8 KV engines beside fp32 PEFT at the 7B shape: 63 GiB). The 80 GB of
      # an H100 are shared by the 4 workers, so a test that failed there may have failed for
      # memory: each is run again alone, and only a test that fails alone too fails the mode.
      local workers alone
      alone="whole_pool or test_host_copies or past_2_31 or widened_ties or test_shared_process"
      gpu_tests gpu-tests-workers.log "$(left "${TESTS_LIMIT:-360}")" --durations=15 -n 4 \
        --dist loadgroup tests/kernels tests/engine -k "not ($alone)"
      workers=$?
      # pytest's status 1 is "some tests failed" (rerun below); any other one means the run itself
      # broke off (124: cut at its limit) and its unrun tests are unchecked
      [ "$workers" -le 1 ] || { echo "the workers' run ended with status $workers" >&2; status=1; }
      gpu_tests gpu-tests-alone.log "$(left 240)" --durations=5 tests/kernels tests/engine \
        -k "$alone" || status=1
      rerun_alone gpu-tests-workers.log || status=1
      cat "$dir"/gpu-tests-{workers,alone,rerun}.log > "$dir/gpu-tests.log"
      ;;
  esac
}

# --- benchmarks ----------------------------------------------------------------------------------
# the acceptance workload (benchmarks/README.md) with PEFT's one static batch of 64 rows
ACCEPTANCE=(--requests 2000 --peft-requests 64 --peft-batch 64 --peft-adapters 1 --peft-max-seconds 150)

mode_bench() {
  case "$part" in
    "")
      bench "$dir" 580 "${ACCEPTANCE[@]}" --systems base,slora,peft,bmm,no-unified,arrival \
        --adapters 1,10,100,1000,2000 --ablation-adapters 1000 --max-seconds 20 --total-seconds 560
      ;;
    prefix)
      # at 50 adapters, 45 s cuts: slora and slora-off (the standard workload, nothing shared);
      # prefix and prefix-off (4000 rows, a 1024-token prefix per adapter, suffixes 32-128, 64
      # output tokens); samples (500 prompts, n = 8) and samples-separate (8 requests of each)
      bench "$dir" 575 --systems slora,slora-off,prefix,prefix-off,samples,samples-separate \
        --adapters 50 --requests 2000 --prefix-rows 4000 --prefix-tokens 1024 \
        --prefix-min-suffix 32 --prefix-max-suffix 128 --prefix-output 64 \
        --samples-prompts 500 --samples-n 8 --max-seconds 45 --total-seconds 545
      ;;
    dora)
      # slora@1000 beside slora-dora@1000 (the same requests and ids, one id in four a DoRA
      # adapter of its rank), Llama-2-7B shapes, 2000 requests. Uncut, slora@1000 takes about
      # 50 s (H200) to 90 s (H100): 90 s cuts keep the whole batch or nearly, and the two runs
      # with their set-ups (each engine makes the weights, warms up both kinds of each rank)
      # about 4-5 min
      bench "$dir" 575 --systems slora,slora-dora --adapters 1000 --requests 2000 \
        --max-seconds 90 --total-seconds 545
      ;;
    fp8a)
      # base, slora@1000 and slora-fp8a@1000 (the same requests and ids, the adapters' A and B
      # rows in e4m3: adapter_dtype fp8), Llama-2-7B shapes, 2000 requests, side by side, cut
      # at 40 s each (three set-ups and runs in about 4 min)
      bench "$dir" 400 --systems base,slora,slora-fp8a --adapters 1000 --requests 2000 \
        --max-seconds 40 --total-seconds 380
      ;;
    score)
      # the scoring rows: score at 1000 adapters against peft-score at 1 and 100, 120 s cuts
      bench "$dir" 575 --systems score,peft-score --adapters 1000 --peft-adapters 1,100 \
        --max-seconds 120 --peft-max-seconds 120 --total-seconds 545
      ;;
    json)
      # the standard requests under a JSON schema at 1000 adapters, uncut, against json-free (the
      # same requests unconstrained at the lengths json produced): the constraint's price a token
      python3 -m pip install -q --no-index --find-links wheels xgrammar \
        || { echo "bench json: install xgrammar from wheels/ (carry it)" >&2; exit 2; }
      bench "$dir" 570 --requests 2000 --systems json,json-free --adapters 1000 --max-seconds 0 \
        --total-seconds 540
      ;;
    lora)
      # llama3-8b slora@1000 uncut with the decode LoRA kernels' default knobs, then the tokens
      # in batch order (vsorted 0), then aligned steps (valign 1): SLORA_LORA_BLOCKS a run
      for knobs in default:'{}' batch-order:'{"vsorted": 0}' aligned:'{"valign": 1}'; do
        SLORA_LORA_BLOCKS=${knobs#*:} bench "$dir/${knobs%%:*}" 180 --model-preset llama3-8b \
          --requests 2000 --systems slora --adapters 1000 --max-seconds 0 --total-seconds 0
      done
      ;;
    tp)
      # two GPUs: base and slora on one device beside base-par and slora-par at tensor parallel
      # 2, then at data parallel 2 (7B, 1000 adapters, 15 s cuts); then the 70B preset at tensor
      # parallel 2 (no card holds it alone), 100 adapters
      need_gpus 2
      for layout in tp2-7b:--tensor-parallel dp2-7b:--data-parallel; do
        bench "$dir/${layout%%:*}" 180 "${layout#*:}" 2 --adapters 1000 --max-seconds 15 \
          --total-seconds 160
      done
      bench "$dir/tp2-70b" 200 --model-preset llama2-70b --tensor-parallel 2 \
        --systems base-par,slora-par --adapters 100 --max-seconds 20 --total-seconds 180
      ;;
  esac
}

mode_profile() { # the bench's workload at 2000 requests, steady-state steps under torch.profiler
  local preset=${part:-llama2-7b} counts=(--adapters 0,1000 --profile-steps 60)
  [ -n "$part" ] || counts=(--adapters 0,10,2000 --profile-steps 90 --rows 25)
  timeout 560 python3 -m benchmarks.profile_engine --preset "$preset" "${counts[@]}" \
    --requests 2000 --trace --out "$dir" > "$dir/profile.log" 2>&1 || status=1
  grep -E "^adapters|profiled" "$dir/profile.log"
  cat "$dir"/steps-*.md
}

mode_kernels() {
  local name limit args
  for args in "kernels 200 --quick --decode-sweep" "vector-sweep 170 --vector-sweep" \
    "tiled-sweep 190 --tiled-sweep"; do
    read -r name limit args <<< "$args"
    # shellcheck disable=SC2086 # the options split into words
    timeout "$limit" python3 -m benchmarks.kernels $args > "$dir/$name.md" 2>&1 || status=1
    cat "$dir/$name.md"
  done
}

fp8_attention_kernels() { # fp8 pages against bf16 pages, fused activation quantizers (--quick)
  timeout 100 python3 -m benchmarks.fp8_kernels --quick > "$dir/fp8-kernels.md" 2>&1 || status=1
  cat "$dir/fp8-kernels.md"
}
fp8_kv_pair() { # Llama-2-7B slora@1000 uncut at max_num_seqs auto, bf16 KV then fp8 KV
  local kv
  for kv in auto fp8; do
    bench "$dir/llama2-7b-kv-$kv" 130 --requests 2000 --systems slora --adapters 1000 \
      --kv-cache-dtype "$kv" --max-seconds 0 --total-seconds 0
  done
}
mode_fp8() {
  # decode and prefill attention on fp8 pages against bf16 pages and the fused activation
  # quantizers (fp8_kernels --quick: MHA decode at B=256, default tiles), then the engine
  # uncut at max_num_seqs auto: Llama-2-7B slora@1000 with bf16 KV and fp8 KV, then Llama-3-8B
  # base with bf16 against fp8 weights + fp8 KV. Part slora: Llama-3-8B slora@1000 with bf16
  # against fp8 weights + fp8 KV, uncut
  if [ "$part" = slora ]; then
    for weights in auto fp8; do
      local kv=auto
      [ "$weights" = fp8 ] && kv=fp8
      bench "$dir/llama3-8b-slora-$weights" 270 --model-preset llama3-8b --requests 2000 \
        --systems slora --adapters 1000 --weights "$weights" --kv-cache-dtype "$kv" \
        --max-seconds 0 --total-seconds 0
    done
    return
  fi
  if [ "$part" = kv ]; then # the engine pair first: a call cut short keeps it
    fp8_kv_pair
    fp8_attention_kernels
    return
  fi
  fp8_attention_kernels
  fp8_kv_pair
  bench "$dir/llama3-8b-bf16" 95 --model-preset llama3-8b --requests 2000 --systems base \
    --max-seconds 0 --total-seconds 0
  bench "$dir/llama3-8b-fp8" 95 --model-preset llama3-8b --requests 2000 --systems base \
    --weights fp8 --kv-cache-dtype fp8 --max-seconds 0 --total-seconds 0
}

mode_families() { # base and slora@1000 on the standard workload at each preset's shapes
  if [ -n "$part" ]; then
    bench "$dir" 560 --model-preset "$part" --requests 2000 --systems base,slora --adapters 1000 \
      --max-seconds 0 --total-seconds 0
    return
  fi
  for preset in llama3-8b qwen3-8b gemma2-9b; do
    bench "$dir/$preset" 150 --model-preset "$preset" --requests 2000 --systems base,slora \
      --adapters 1000 --max-seconds 15 --total-seconds 130
  done
}

mode_moe() {
  # Qwen3-30B-A3B's shapes (61 GB of bf16 weights, made on the card tensor by tensor), the
  # standard 2000 requests, each pair side by side in one process: base and slora@1000 with
  # adapters on q, k, v, o (ranks 8-64); base and slora@100 with adapters on q, k, v, o and every
  # expert's gate_up and down (ranks 8 and 16, 0.62 and 1.24 GB each, 2 weight sets). Uncut, a
  # run would take about 80-110 s (a decode step reads ~61 GB once its rows reach every expert,
  # ~20 ms at the H100's copy rate, for a few hundred tokens), four of them and the set-ups past
  # 600 s: each run is cut at 45 s (the tokens computed by then count).
  # slora@1000 with the adapter cap at 1024: two rows an adapter, so the default 256 holds a
  # batch to about 360 rows where an H200's pool holds 600 (python -m benchmarks.moe_bounds)
  bench "$dir/attention" 280 --model-preset qwen3-30b-a3b --requests 2000 --systems base,slora \
    --adapters 1000 --max-adapters-per-batch 1024 --max-seconds 45 --total-seconds 265
  bench "$dir/experts" 280 --model-preset qwen3-30b-a3b --requests 2000 --systems base,slora \
    --adapters 100 --adapter-targets experts --max-seconds 45 --total-seconds 265
}

mode_job() { # the job path (model and adapter directories on disk, Parquet in and out), uncut
  case "$part" in
    "")
      bench "$dir" 570 --requests 4000 --systems slora,job --adapters 1000 --max-seconds 0 \
        --total-seconds 0
      ;;
    dp)
      need_gpus 2
      bench "$dir" 570 --data-parallel 2 --requests 4000 --systems slora-par,job-par \
        --adapters 1000 --max-seconds 0 --total-seconds 0
      ;;
  esac
}

mode_eval() {
  # lm-eval and its missing dependencies travel in wheels/ (carried), with the sample model's
  # tokenizer in wheels/smollm2-tokenizer; each wheel as it is, no resolution (the image's own
  # pyarrow, fsspec and hub stay). A 7B-shaped model over 100 adapters and the base on a
  # 48-document multiple-choice task (eval), beside the engine alone on the same rows (eval-score)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl \
    || { echo "eval: install lm-eval from wheels/ (carry it)" >&2; exit 2; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  bench "$dir" "${EVAL_LIMIT:-450}" --systems eval-score,eval --adapters 100 \
    --tokenizer wheels/smollm2-tokenizer --eval-docs 48 --max-seconds 0 --total-seconds 0
}

"mode_$mode"
echo "card: $card; copy ${OUT:-out/device}/$mode/ to benchmarks/results/$card/$mode/ (status $status)"
exit "$status"
