#!/usr/bin/env bash
# One device call's worth of work on the GPU machine: build, run every test (GPU tests
# included), then the benchmarks. Logs and JSON results go to $OUT (the device tool brings
# them back). Usage (device tool, carry [".deps"]): bash scripts/gpu_check.sh [stages...]
# Stages: build test target load drafter decode kernels prefill spec train pipeline overlap cudnn
# profile (AB="FLAGS|FLAGS" to compare other `dflash bench` flags) levers (ATTENTIONS="A,B") final verify rows
# pretrain gsm8k tokenizer moe fp8 (HEAD_GRADS="fp8,compute") gsm8k_fp8 sustained gemms
# gsm8k_ab (GSM8K_AB="FLAGS|FLAGS") tuned attn fifth gtest (GTEST_FILTER) fp8target gdn hybrid
# online (ONLINE_PRESETS, ONLINE_STEPS) mxfp4 (MXFP4_PRESETS, MXFP4_GEMMS)
# gsm8k_serving (after gsm8k: bf16 eval at batch 1 and 16, the z-lab-style peer; GSM8K_PEER_PROMPTS;
# GSM8K_PACK=1 packs the run) gsm8k_packed (a packed run from .runpack, for gsm8k_serving)
# (TRAIN_ARGS: more `dflash train` options for `train`)
# (default: the first five).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
stages=${*:-build test target load drafter}
build=${BUILD_DIR:-$root/build-gpu}
dflash=$build/src/dflash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
has() { [[ " $stages " == *" $1 "* ]]; }
step() { echo "=== $* ($(date +%T))"; }
# fixtures NAME MODULE...: the Python reference fixtures the GPU tests read (log fixtures_NAME.log).
fixtures() {
  local name=$1; shift
  # Fixtures made here (scripts/make_gpu_fixtures.sh) travel as .fixtures: this machine's
  # transformers is older than the test venv's, and some references need the newer one.
  if [ -d "$root/.fixtures" ]; then
    mkdir -p "$build/fixtures" && cp -rn "$root/.fixtures/." "$build/fixtures/"
  fi
  local missing=()
  for m in "$@"; do [ -e "$root/.fixtures/.made_$m" ] || missing+=("$m"); done
  [ ${#missing[@]} -eq 0 ] && return
  python3 "$root/tests/python/make_fixtures.py" --out "$build/fixtures" --only "${missing[@]}" \
    > "$out/fixtures_$name.log" 2>&1 || tail -20 "$out/fixtures_$name.log"
}
# gtests NAME FILTER: the core tests matching FILTER (GPU ones included), log NAME_tests.log.
gtests() {
  DFLASH_PYTHON=$(command -v python3) "$build/tests/dflash_core_tests" --gtest_filter="$2" \
    > "$out/$1_tests.log" 2>&1
  echo "$1 tests exit $?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|tests ran" "$out/$1_tests.log" | tail -25
}
# AB="FLAGS A|FLAGS B|..." ab_bench NAME: `dflash bench` with each set of flags, alternating, twice
# each (run-to-run variance is ~1-2%, so a lever needs its baseline in the same call).
ab_bench() {
  local name=$1 rep flags i
  IFS='|' read -ra variants <<< "$AB"
  for rep in 1 2; do
    for i in "${!variants[@]}"; do
      flags=${variants[$i]}
      step "bench $name: $flags ($rep)"
      # shellcheck disable=SC2086  # the flags split into arguments
      "$dflash" bench --steps 30 --warmup 8 $flags --json "$out/bench_${name}_${i}_$rep.json" 2>&1 \
        | grep -v "^train:" | tee -a "$out/bench_$name.txt"
    done
  done
}
# ab_drafter NAME OPTION "A,B": bench-drafter with OPTION's two settings alternating in one
# process (profiles of the first; nvidia-smi's clock, power and temperature alongside), then
# `dflash bench` alternating them (AB overrides).
ab_drafter() {
  local name=$1 option=$2 settings=$3 smi
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$out/clocks_$name.csv" 2>&1 &
  smi=$!
  "$dflash" bench-drafter --device cuda "$option" "$settings" \
    --json "$out/bench_drafter_$name.json" --profile "$out/drafter_trace_$name.json" 2>&1 \
    | tee "$out/bench_drafter_$name.txt" | grep -v "^ .*\] " | head -60
  gzip -f "$out/drafter_trace_$name.json" "$out/drafter_trace_$name.online.json"
  kill "$smi" 2>/dev/null
  AB="${AB:-$option=${settings%%,*}|$option=${settings#*,}}" ab_bench "$name"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
if has build; then
  step build
  "$root/scripts/gpu_build.sh" > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
  tail -3 "$out/build.log"
fi
if has test; then
  # The LibTorch tests, GPU ones included (they skip on CPU CI). Tokenizer fixtures need the
  # GSM8K data in ../shared, which does not travel to this machine; CI runs those.
  step test
  fixtures test models dflash safetensors pretrain gpt_oss tp fp8
  fixtures rope rope
  gtests core '*'
fi
if has target; then
  step bench-target
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1,2,4,8 \
    --warmup 3 --iters 10 --json "$out/bench_target.json" --profile "$out/target_trace.json" \
    2>&1 | tee "$out/bench_target.txt"
  gzip -f "$out/target_trace.json"
fi
if has load; then
  step load
  ckpt=/tmp/qwen3-8b-random
  "$dflash" random-model --preset qwen3-8b --out "$ckpt" 2>&1 | tee "$out/load.txt"
  sync
  # Cold page cache where the machine allows it, so the load reads the disk.
  echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" | tee -a "$out/load.txt"
  "$dflash" info "$ckpt" --load cuda 2>&1 | tee -a "$out/load.txt"
  rm -rf "$ckpt"
fi
if has drafter && "$dflash" bench-drafter --help > /dev/null 2>&1; then
  # The drafter step's kernels and its parity (gathered keys, prefix attention, loss,
  # optimizer) before timing it.
  gtests drafter '*PrefixGather*:*PrefixAttention*:*HeadLoss*:*DrafterGpu*:*DrafterParity*:*AdamW*:*GradNorm*:*TailAttention*:*DraftModelVsTraining*'
  step bench-drafter
  "$dflash" bench-drafter --device cuda --json "$out/bench_drafter.json" \
    --profile "$out/drafter_trace.json" 2>&1 | tee "$out/bench_drafter.txt"
  gzip -f "$out/drafter_trace.json"
  # New anchors every step, as training draws them: the allocated and reserved peaks show
  # whether the varying gathered-key count still fragments the caching allocator.
  "$dflash" bench-drafter --device cuda --fresh-anchors --iters 30 \
    --json "$out/bench_drafter_fresh.json" 2>&1 | tee "$out/bench_drafter_fresh.txt"
fi
if has decode; then
  # Generation: the decoding tests (flash attention over the KV cache, CUDA-graph replay
  # against eager), then bench-decode on the Qwen3-8B shape (batch 1 and 128, graph on/off).
  step decode
  gtests decode '*KVCache*:*Generator*:*DecodeGpu*:*Sampling*'
  "$dflash" bench-decode --preset qwen3-8b --device cuda --json "$out/bench_decode.json" 2>&1 \
    | tee "$out/bench_decode.txt"
fi
if has kernels; then
  # The decode step's kernels (kernels/small_linear.h, kernels/decode_ops.h): their tests
  # against the fp32 references, the target's fused decode path against its ATen path, the
  # decoding tests that compare decode with the packed forward and speculative with greedy in
  # bf16; then each kernel alone against the ATen ops it replaces, and bench-decode at batch 1
  # and 128 with a profile of the batch-1 step.
  step kernels
  gtests kernel '*SmallLinear*:*DecodeOps*:*FusedDecode*:*DecodeGpu*:*Generator*:*SpeculativeGpu*:*Rotary*'
  "$dflash" bench-kernels --json "$out/bench_kernels.json" 2>&1 | tee "$out/bench_kernels.txt"
  "$dflash" bench-decode --preset qwen3-8b --device cuda --batches 1,128 \
    --json "$out/bench_decode_kernels.json" --profile "$out/decode_trace.json" 2>&1 \
    | tee "$out/bench_decode_kernels.txt"
  gzip -f "$out/decode_trace.json"
fi
if has tuned; then
  # Issue 11, 2026-12-02 (fourth session): the target's projections through cuBLASLt with the
  # algorithm timed once per shape among the candidates equal to at::linear's bits. The tests
  # (bitwise against at::linear, the prefill's taps unchanged), then bench-target alternating
  # tuned and at::linear in one process (3 rounds of 20 queued prefills), nvidia-smi alongside,
  # a profile of the first, and `dflash bench` alternating --prefill-gemms (AB overrides).
  step tuned
  fixtures tuned models
  fixtures tuned_rope rope
  gtests tuned '*TunedGemm*:*FusedPrefill*:*CudnnAttention*:*TargetGpu*:*QuantizeRows*:*QuantizeColumns*:*Fp8Rows*'
  grep -h "cuBLASLt candidates" "$out/tuned_tests.log" | head -20
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$out/clocks_tuned.csv" 2>&1 &
  smi=$!
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 5 \
    --iters 20 --attention cudnn --gemm tuned,aten --rounds 3 \
    --json "$out/bench_target_tuned.json" --profile "$out/target_trace_tuned.json" 2>&1 \
    | tee "$out/bench_target_tuned.txt"
  gzip -f "$out/target_trace_tuned.json"
  kill "$smi" 2>/dev/null
  if [ "${NO_BENCH:-0}" != 1 ]; then
    AB="${AB:---prefill-gemms tuned|--prefill-gemms aten}" ab_bench tuned
  fi
fi
if has fp8target; then
  # Issue 11, sixth session: the target's prefill projections in FP8 (--prefill-gemms fp8). The
  # GPU tests, bench-target alternating tuned and fp8 (3 rounds of 20 queued prefills; profile
  # of fp8), nvidia-smi alongside, then `dflash bench` alternating them (AB overrides).
  step fp8target
  fixtures fp8target models
  fixtures fp8target_rope rope
  gtests fp8target "${GTEST_FILTER:-*Fp8*:*TargetGpu*:*FusedPrefill*:*TunedGemm*:*PrefillGemm*}"
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$out/clocks_fp8target.csv" 2>&1 &
  smi=$!
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 5 \
    --iters 20 --attention cudnn --gemm fp8,tuned --rounds 3 \
    --json "$out/bench_target_fp8.json" --profile "$out/target_trace_fp8.json" 2>&1 \
    | tee "$out/bench_target_fp8.txt"
  gzip -f "$out/target_trace_fp8.json"
  kill "$smi" 2>/dev/null
  if [ "${NO_BENCH:-0}" != 1 ]; then
    AB="${AB:---prefill-gemms fp8|--prefill-gemms tuned}" ab_bench fp8target
  fi
fi
if has gtest; then
  # The GPU tests matching GTEST_FILTER, with every fixture set they may read.
  step gtest
  fixtures gtest dflash models
  fixtures gtest_rope rope
  fixtures gtest_gpt_oss gpt_oss
  fixtures gtest_more pretrain qwen35 gated_delta tp fp8
  gtests gtest "${GTEST_FILTER:-*Gpu*}"
fi
if has hybrid; then
  # Issue 35: the hybrid targets on the GPU (bf16 against the fp32 reference: Qwen35Gpu), then
  # bench-target at the published shapes beside the dense qwen3-8b and the transformers + fla-core
  # peer (bench/qwen35_peer.py; carry ".whl") in the same call.
  step hybrid
  fixtures hybrid qwen35
  gtests hybrid '*Qwen35*:*Hybrid*'
  # HYBRID_GEMMS: the prefill GEMMs bench-target alternates (tuned bf16 and fp8 by default).
  for preset in qwen3-8b qwen3.5-27b qwen3.5-35b-a3b; do
    "$dflash" bench-target --preset "$preset" --device cuda --seq-len 2048 --batches 1,4 \
      --gemm "${HYBRID_GEMMS:-tuned,fp8}" --warmup 3 --iters 10 \
      --json "$out/bench_target_$preset.json" 2>&1 | tee "$out/bench_target_$preset.txt" | tail -8
  done
  if ls "$root"/.whl/fla_core-*.whl > /dev/null 2>&1; then
    pip install --no-index --no-deps "$root"/.whl/*.whl --target /tmp/gdn_peer \
      > "$out/hybrid_peer_install.log" 2>&1 || tail -5 "$out/hybrid_peer_install.log"
    for preset in qwen3.5-27b qwen3.5-35b-a3b; do
      PYTHONPATH=/tmp/gdn_peer python3 "$root/bench/qwen35_peer.py" --preset "$preset" --rows 1 2>&1 \
        | tee "$out/qwen35_peer_$preset.txt" | tail -6
    done
  fi
fi
if has online; then
  # The online step (`dflash bench`: random target of the preset, 5-layer drafter, 2048 tokens,
  # 512 anchors) per preset in ONLINE_PRESETS: tokens/s, MFU, memory (issue 35's hybrids beside
  # the dense Qwen3-8B).
  step online
  for preset in ${ONLINE_PRESETS:-qwen3-8b qwen3.5-27b qwen3.5-35b-a3b}; do
    "$dflash" bench --preset "$preset" --steps "${ONLINE_STEPS:-20}" --warmup 5 \
      --json "$out/online_$preset.json" 2>&1 | grep -v "^train:" | tee "$out/online_$preset.txt" \
      | tail -12
  done
fi
if has gdn; then
  # Issue 35: Gated DeltaNet's kernels (kernels/gated_delta_rule.h, kernels/causal_conv1d.h)
  # against their references and the references against transformers, then each timed at
  # Qwen3.5-27B shapes: with the fla-core peer in the same process when its wheels travelled
  # (carry ".whl", which holds causal-conv1d's cp312 wheel when scripts/gather_peers.sh built it;
  # bench/gdn_peer.py; GDN_CAUSAL_CONV1D=1 builds causal-conv1d's sdist here instead),
  # else ours alone.
  step gdn
  fixtures gdn gated_delta
  gtests gdn '*GatedDelta*:*CausalConv*'
  if ls "$root"/.whl/fla_core-*.whl > /dev/null 2>&1; then
    pip install --no-index --no-deps "$root"/.whl/*.whl --target /tmp/gdn_peer \
      > "$out/gdn_peer_install.log" 2>&1 || tail -5 "$out/gdn_peer_install.log"
    if [ -n "${GDN_CAUSAL_CONV1D:-}" ]; then
      # causal-conv1d 1.7.0 is an sdist: built here for sm_90 alone (its setup.py lists nine
      # architectures), minutes of nvcc, so only when asked.
      rm -rf /tmp/gdn_cc1d && mkdir -p /tmp/gdn_cc1d
      tar xzf "$root"/.whl/causal_conv1d-1.7.0.tar.gz -C /tmp/gdn_cc1d
      sed -i 's/^    if FORCE_CXX11_ABI:/    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]\n&/' \
        /tmp/gdn_cc1d/causal_conv1d-1.7.0/setup.py
      # python3 -m pip: the pip on PATH may be another Python's, without torch to build against.
      CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=16 python3 -m pip install --no-index --no-deps \
        --no-build-isolation /tmp/gdn_cc1d/causal_conv1d-1.7.0 --target /tmp/gdn_peer \
        > "$out/causal_conv1d_build.log" 2>&1 || tail -20 "$out/causal_conv1d_build.log"
    fi
    PYTHONPATH=/tmp/gdn_peer python3 "$root/bench/gdn_peer.py" --dflash "$dflash" 2>&1 \
      | tee "$out/gdn_peer.txt"
  else
    "$dflash" bench-kernels --gated-delta-only --json "$out/bench_gdn.json" 2>&1 \
      | tee "$out/bench_gdn.txt"
  fi
fi
if has mxfp4; then
  # Issue 38: gpt-oss' MXFP4 expert GEMMs alone at gpt-oss-120b's shapes (bench-kernels
  # --mxfp4-only: each path by tokens), then gpt-oss prefill with each --mxfp4-gemm (auto: the
  # fused kernels, the experts never in bf16; dequantize: each layer's experts in bf16 first) with
  # nvidia-smi's memory in use sampled alongside, and the transformers peer on gpt-oss-20b.
  step mxfp4
  "$dflash" bench-kernels --mxfp4-only --device cuda --iters 20 --json "$out/bench_mxfp4.json" \
    2>&1 | tee "$out/bench_mxfp4.txt"
  for preset in ${MXFP4_PRESETS:-gpt-oss-20b gpt-oss-120b}; do
    for gemm in ${MXFP4_GEMMS:-auto dequantize}; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
        > "$out/smi_${preset}_$gemm.csv" 2>&1 &
      smi=$!
      "$dflash" bench-target --preset "$preset" --device cuda --seq-len 2048 --batches 1,4 \
        --mxfp4-gemm "$gemm" --warmup 3 --iters 10 --json "$out/bench_target_${preset}_$gemm.json" \
        2>&1 | tee "$out/bench_target_${preset}_$gemm.txt" | tail -4
      kill "$smi" 2>/dev/null
      echo "nvidia-smi memory used, max MiB: $(sort -n "$out/smi_${preset}_$gemm.csv" | tail -1)"
    done
  done
  python3 "$root/bench/gpt_oss_peer.py" --preset gpt-oss-20b 2>&1 | tee "$out/gpt_oss_peer.txt" \
    | tail -4
fi
if has attn; then
  # Issue 11, fifth session: the prefill's causal attention, ATen's cuDNN call against ours
  # through the same graph and flash's (bench-kernels' "prefill attention" lines: us, TFLOP/s,
  # host us per call, bits against ATen's).
  step attn
  gtests attn '*CudnnAttention*:*FusedPrefill*:*AttentionBackend*'
  "$dflash" bench-kernels --json "$out/bench_kernels_attn.json" > "$out/bench_kernels_attn.txt" 2>&1
  echo "bench-kernels exit $?"
  grep -A1000 "prefill attention" "$out/bench_kernels_attn.txt" | head -80
fi
if has fifth; then
  # Issue 11, fifth session's closing figures: the GPU tests of every path the prefill's
  # attention serves (generation and speculative decoding included), then the online step's
  # split (`bench-drafter`, with profiles), the prefill alone over 3 rounds, and `dflash bench`
  # twice, nvidia-smi alongside.
  step fifth
  fixtures fifth dflash models
  fixtures fifth_rope rope
  gtests fifth '*Cudnn*:*FusedPrefill*:*TargetGpu*:*FusedDecode*:*KVCache*:*DraftModel*:*Speculative*:*Generator*:*TrainLoop*:*TunedGemm*'
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$out/clocks_fifth.csv" 2>&1 &
  smi=$!
  "$dflash" bench-drafter --device cuda --json "$out/bench_drafter_fifth.json" \
    --profile "$out/drafter_trace_fifth.json" 2>&1 | tee "$out/bench_drafter_fifth.txt" \
    | grep -v "^ .*\] " | head -40
  gzip -f "$out/drafter_trace_fifth.json" "$out/drafter_trace_fifth.online.json"
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 5 \
    --iters 20 --attention cudnn --gemm tuned --rounds 3 --json "$out/bench_target_fifth.json" 2>&1 \
    | tee "$out/bench_target_fifth.txt" | grep -v "^ .*\] "
  AB="${AB:---prefill-gemms tuned}" ab_bench fifth
  kill "$smi" 2>/dev/null
fi
if has prefill; then
  # Issue 11: the target's prefill with the fused kernels at thousands of rows (against the ATen
  # path, fp32 and transformers), cuDNN's attention against flash's, then bench-target at one
  # sequence of 2048 tokens with each attention backend, each with a profile.
  step prefill
  fixtures prefill models
  fixtures prefill_rope rope
  gtests prefill '*FusedPrefill*:*CudnnAttention*:*AttentionBackend*:*DecodeOps*:*FusedDecode*:*TargetGpu*:*TargetParity*:*KVCache*:*Generator*'
  "$dflash" bench-kernels --json "$out/bench_kernels_prefill.json" 2>&1 \
    | grep -E "^(kernel|qk_norm_rotary|2 rms_norm)" | tee "$out/bench_kernels_prefill.txt"
  for attention in flash cudnn; do
    "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1,4 \
      --warmup 3 --iters 10 --attention $attention --json "$out/bench_prefill_$attention.json" \
      --profile "$out/prefill_${attention}_trace.json" 2>&1 | tee "$out/bench_prefill_$attention.txt"
    gzip -f "$out/prefill_${attention}_trace.json"
  done
fi
if has spec; then
  # Speculative decoding on CUDA: the drafter's inference against its training forward and
  # speculative == greedy (fp32 SDPA and the bf16 flash paths), then `dflash eval` end to end on
  # a tiny random model in bf16 (generator CUDA graph against speculative, the tie check). The
  # draft's cost against a plain decode step is in bench-decode (decode stage).
  step spec
  gtests spec '*DraftModel*:*Speculative*:*Accounting*'
  python3 "$root/tests/cli/eval_cli.py" "$dflash" cuda > "$out/eval_cli.log" 2>&1
  echo "eval_cli exit $?"; tail -5 "$out/eval_cli.log"
  # tau during `dflash train --eval-prompts` on CUDA in bf16 (the verify pass captured while the
  # trainer's batch-forming thread is paused) == `dflash eval` of the same checkpoints.
  python3 "$root/tests/cli/train_eval.py" "$dflash" cuda > "$out/train_eval.log" 2>&1
  echo "train_eval exit $?"; tail -5 "$out/train_eval.log"
fi
if has train; then
  step train
  # shellcheck disable=SC2086  # TRAIN_ARGS: more `dflash train` options, split into arguments
  (cd "$root" && bash bench/train_e2e.sh "$dflash" "$out" "${TRAIN_STEPS:-40}" ${TRAIN_ARGS:-})
fi
if has train2 && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  step train on 2 GPUs
  (cd "$root" && bash bench/train_e2e.sh "$dflash" "$out" 40 --nproc-per-node 2 --batch-size 2 \
    --accumulation 2)
fi
if has pipeline; then
  # The multi-rank pipeline: equivalence of topologies and kill/resume under NCCL (fp32), then
  # `dflash bench` (random Qwen3-8B-shaped target, 1.05B drafter, 2048 tokens, 512 anchors) on
  # one GPU and, where there are two, both topologies.
  step pipeline-test
  python3 "$root/tests/cli/dist_train.py" "$dflash" auto > "$out/dist_train_gpu.log" 2>&1
  echo "dist_train exit $?"; tail -12 "$out/dist_train_gpu.log"
  gpus=$(nvidia-smi -L | wc -l)
  step bench 1 GPU
  "$dflash" bench --steps 30 --warmup 8 --json "$out/bench_1gpu.json" 2>&1 | grep -v "^train:" \
    | tee "$out/bench.txt"
  if [ "$gpus" -ge 2 ]; then
    for acc in 1 4; do
      step bench 2 GPUs colocated accumulation $acc
      "$dflash" bench --nproc-per-node 2 --batch-size 2 --accumulation $acc --steps $((24 / acc + 6)) \
        --warmup 4 --json "$out/bench_2gpu_colocated_acc$acc.json" 2>&1 | grep -v "^train:" \
        | tee -a "$out/bench.txt"
    done
    step bench 2 GPUs disaggregated 1 target + 1 trainer
    "$dflash" bench --nproc-per-node 2 --topology disaggregated --target-ranks 1 --steps 30 \
      --warmup 8 --json "$out/bench_2gpu_disaggregated.json" 2>&1 | grep -v "^train:" \
      | tee -a "$out/bench.txt"
  fi
fi
if has overlap; then
  # Issue 11: the colocated target forward on its own stream beside the drafter's backward.
  # Bitwise against one stream (fp32 with accumulation, bf16), then `dflash bench` with and
  # without it.
  step overlap
  fixtures overlap dflash
  gtests overlap '*TrainLoopOverlapGpu*:*TrainLoop*'
  AB="--overlap-target=false|--overlap-target=true" ab_bench overlap
fi
if has cudnn; then
  # Issue 11: the shared segments' attention backward through cuDNN (kernels/cudnn_attention),
  # against fp64 and flash's backward, in the block attention and in the drafter step; then its
  # bench-kernels lines beside flash's, and the drafter step with each.
  step cudnn
  fixtures cudnn dflash
  gtests cudnn '*CudnnAttentionBackward*:*PrefixAttentionGpu*:*DrafterGpu*:*DrafterParity*'
  "$dflash" bench-kernels --json "$out/bench_kernels_cudnn.json" 2>&1 \
    | grep -E "^(kernel|shared backward|tail backward|tail_attention|gather \+ flash|cross_entropy)" \
    | tee "$out/bench_kernels_cudnn.txt"
  for attention in gathered gathered-cudnn-shared gathered-cudnn; do
    "$dflash" bench-drafter --device cuda --attention $attention \
      --json "$out/bench_drafter_$attention.json" 2>&1 | tail -5 | tee -a "$out/bench_drafter_cudnn.txt"
  done
fi
if has profile; then
  # Issue 11: where the online step's time goes now. The loss kernel's tests and bench line,
  # the drafter step and the prefill each with a profile (the traces show the GPU's idle gaps
  # and what follows them), then the drafter's attention backward, flash's against the default.
  step profile
  fixtures profile dflash
  gtests profile '*CrossEntropyKernel*:*HeadLoss*:*DrafterGpu*:*DrafterParity*'
  "$dflash" bench-kernels --json "$out/bench_kernels_profile.json" 2>&1 \
    | grep -E "^(kernel|cross_entropy|shared backward|tail backward)" | tee "$out/bench_kernels_profile.txt"
  "$dflash" bench-drafter --device cuda --json "$out/bench_drafter_profile.json" \
    --profile "$out/drafter_trace.json" 2>&1 | tee "$out/bench_drafter_profile.txt"
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 3 \
    --iters 10 --attention cudnn --json "$out/bench_target_profile.json" \
    --profile "$out/target_trace.json" 2>&1 | tee "$out/bench_target_profile.txt"
  gzip -f "$out/drafter_trace.json" "$out/target_trace.json"
  # New anchors every step: the cuDNN graphs are cached per segment count, so the first steps
  # of each count build one; flash's backward alongside for the difference.
  for attention in auto gathered; do
    "$dflash" bench-drafter --device cuda --fresh-anchors --iters 30 --attention $attention \
      --json "$out/bench_drafter_fresh_$attention.json" 2>&1 | tail -4 \
      | tee -a "$out/bench_drafter_fresh.txt"
  done
  AB="${AB:---drafter-attention=gathered|--drafter-attention=auto}" ab_bench attention
fi
if has levers; then
  # Issue 11, 2026-12-02: the attention-input and gate/up projections as one autograd node each
  # (models/linear_group), cuDNN's forward over the shared segments, and the kernels changed
  # after the last device call (the loss kernel's staging, Pack<T, N>), tested, then each lever
  # beside its baseline in one call: bench-kernels lines, bench-drafter with each attention
  # setting (the online step split into its prefill and drafter parts), and the prefill queued
  # as training queues it against waited for.
  step levers
  fixtures levers dflash
  gtests levers '*LinearGroup*:*CudnnAttention*:*PrefixAttention*:*PrefixGather*:*TailAttention*:*DrafterGpu*:*DrafterParity*:*AdamW*:*GradNorm*:*CrossEntropyKernel*:*HeadLoss*:*DecodeOps*:*DraftModel*:*TrainLoop*'
  "$dflash" bench-kernels --json "$out/bench_kernels_levers.json" 2>&1 \
    | grep -E "^(kernel|linear_group|5 x at::linear|q/k/v|shared forward|shared backward|cross_entropy|qk_norm_rotary)" \
    | tee "$out/bench_kernels_levers.txt"
  # SM clock, power and temperature every half second while the drafter runs: whether the
  # GEMMs run at the power cap (machine-to-machine differences).
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$out/clocks_levers.csv" 2>&1 &
  smi=$!
  # The settings alternate in one process (3 rounds), then the first runs the rest: synced,
  # online split into prefill and drafter, and the profiles of the drafter and online steps.
  "$dflash" bench-drafter --device cuda --attention "${ATTENTIONS:-auto,gathered-cudnn-shared}" \
    --json "$out/bench_drafter_levers.json" --profile "$out/drafter_trace_levers.json" 2>&1 \
    | tee "$out/bench_drafter_levers.txt" | grep -v "^ .*\] " | head -60
  gzip -f "$out/drafter_trace_levers.json" "$out/drafter_trace_levers.online.json"
  kill "$smi" 2>/dev/null
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 3 \
    --iters 10 --attention cudnn --json "$out/bench_target_levers.json" 2>&1 \
    | tee "$out/bench_target_levers.txt"
  AB="${AB:---drafter-attention=auto|--drafter-attention=gathered-cudnn-shared}" ab_bench levers
fi
if has fp8; then
  # Issue 11, 2026-12-02: the LM head's input gradient as an FP8 GEMM (--head-grad fp8): its
  # tests and the step's, its bench-kernels lines (the loss kernel's fp8 variant, the bf16
  # and FP8 GEMMs of one chunk), bench-drafter alternating compute and fp8 in one process with
  # profiles and nvidia-smi's clock and power, then `dflash bench` alternating (the default,
  # auto, is fp8 on an H200).
  step fp8
  fixtures fp8 dflash
  gtests fp8 '*Fp8*:*CrossEntropy*:*HeadLoss*:*HeadGrad*:*DrafterGpu*:*DrafterParity*:*TrainLoop*:*RunConfig*'
  grep -h "relative error" "$out/fp8_tests.log"
  "$dflash" bench-kernels --json "$out/bench_kernels_fp8.json" 2>&1 \
    | grep -E "^(kernel|cross_entropy|LM-head)" | tee "$out/bench_kernels_fp8.txt"
  ab_drafter fp8 --head-grad "${HEAD_GRADS:-fp8,compute}"
fi
if has gemms; then
  # Issue 11, 2026-12-02: the drafter layers' projections as FP8 GEMMs (--drafter-gemms fp8:
  # forward and input gradients in e4m3 with row scales, weight gradients bf16). The quantizer
  # kernel and linear_group against their references, the step against the fp32 reference,
  # its bench-kernels lines (the quantizer, linear_group with and without fp8), bench-drafter
  # alternating compute and fp8 (with the online split and a profile), then `dflash bench`
  # alternating (NO_BENCH=1: the tests alone).
  step gemms
  fixtures gemms dflash
  gtests gemms '*Fp8*:*QuantizeRows*:*QuantizeColumns*:*LinearGroup*:*DrafterGpu*:*DrafterParity*:*HeadLoss*:*TrainLoop*:*RunConfig*'
  grep -h "fp8 GEMMs:" "$out/gemms_tests.log" | head -40
  if [ "${NO_BENCH:-0}" != 1 ]; then
    "$dflash" bench-kernels --json "$out/bench_kernels_gemms.json" 2>&1 \
      | grep -E "^(kernel|linear_group|5 x at::linear|q/k/v|quantize_|cat \+)" \
      | tee "$out/bench_kernels_gemms.txt"
    ab_drafter gemms --drafter-gemms fp8,compute
  fi
fi
if has sustained; then
  # Issue 11, 2026-12-02: what the power-capped GPU sustains against the short benches'
  # figures. nvidia-smi's clock, power and temperature every half second; `dflash bench` short
  # (30 steps) and long (600 steps, ~100 s; its drift line compares the first and last quarter);
  # bench-target queued for 300 prefills (~14 s; per-prefill times in the JSON).
  step sustained
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$out/clocks_sustained.csv" 2>&1 &
  smi=$!
  "$dflash" bench --steps 30 --warmup 8 --json "$out/bench_short.json" 2>&1 | grep "^bench: step"
  "$dflash" bench --steps 600 --warmup 8 --json "$out/bench_long.json" 2>&1 | grep "^bench: \(step\|drift\|rank\)"
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 3 \
    --iters 300 --attention cudnn --json "$out/bench_target_sustained.json" 2>&1 | tail -2
  kill "$smi" 2>/dev/null
fi
if has gsm8k_fp8 || has gsm8k_ab; then
  # A training setting's effect on what a drafter learns: the GSM8K run (examples/gsm8k,
  # --full) up to its training data, then the drafter trained once per setting of GSM8K_AB
  # ("FLAGS|FLAGS", default the FP8 head gradient against compute; gsm8k_fp8 is that default),
  # with tau on the 100 validation questions every 500 steps (GSM8K_DRAFTER_EPOCHS, 2 here).
  step gsm8k_ab
  run=/tmp/gsm8k-ab
  export GSM8K_DRAFTER_EPOCHS=${GSM8K_DRAFTER_EPOCHS:-2}
  bash "$root/examples/gsm8k/run.sh" --full --data "$root/.deps/gsm8k" --out "$run" \
    --dflash "$dflash" --stages pretrain,generate,prepare > "$out/gsm8k_ab_prepare.log" 2>&1 \
    || tail -20 "$out/gsm8k_ab_prepare.log"
  IFS='|' read -ra settings <<< "${GSM8K_AB:---head-grad compute|--head-grad fp8}"
  for i in "${!settings[@]}"; do
    flags=${settings[$i]}
    step "gsm8k drafter: $flags"
    GSM8K_TRAIN_ARGS="$flags" bash "$root/examples/gsm8k/run.sh" --full \
      --data "$root/.deps/gsm8k" --out "$run" --dflash "$dflash" --stages train \
      > "$out/gsm8k_ab_train_$i.log" 2>&1 || tail -20 "$out/gsm8k_ab_train_$i.log"
    cp "$run/drafter/metrics.jsonl" "$out/gsm8k_metrics_$i.jsonl"
    python3 - "$run/drafter/metrics.jsonl" "$flags" <<'PY' | tee -a "$out/gsm8k_ab.txt"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
tau = {l["step"]: round(l["eval_tau"], 3) for l in lines if "eval_tau" in l}
loss = [l["loss"] for l in lines if "loss" in l]
tail = loss[-200:]
print(f"{sys.argv[2]}: validation tau {tau}; mean loss of the last {len(tail)} steps "
      f"{sum(tail) / max(len(tail), 1):.4f}")
PY
  done
fi
if has final; then
  # Issue 11's closing figures: new anchors every step (new group counts build cuDNN graphs)
  # with the default against cuDNN's shared backward alone, alternating, and the prefill's
  # profile; `train` (TRAIN_STEPS=250) gives the end-to-end run and what the process holds.
  step final
  "$dflash" bench-drafter --device cuda --fresh-anchors --iters 30 \
    --attention auto,gathered-cudnn-shared --json "$out/bench_drafter_final_fresh.json" 2>&1 \
    | tee "$out/bench_drafter_final_fresh.txt"
  "$dflash" bench-target --preset qwen3-8b --device cuda --seq-len 2048 --batches 1 --warmup 3 \
    --iters 20 --attention cudnn --json "$out/bench_target_final.json" \
    --profile "$out/target_trace_final.json" 2>&1 | tee "$out/bench_target_final.txt" \
    | grep -v "^ .*\] "
  gzip -f "$out/target_trace_final.json"
fi
if has verify; then
  # The drafter's GPU tests with the inference paths that share its layer code (draft model,
  # speculative decoding, generator graphs) and the cuDNN probe, then `dflash bench` with the
  # default attention against cuDNN's shared backward alone, alternating.
  step verify
  fixtures verify dflash models
  gtests verify '*LinearGroup*:*Cudnn*:*PrefixAttention*:*PrefixGather*:*TailAttention*:*DrafterGpu*:*DrafterParity*:*AdamW*:*GradNorm*:*HeadLoss*:*DraftModel*:*Speculative*:*Generator*:*TrainLoop*'
  AB="${AB:---drafter-attention=auto|--drafter-attention=gathered-cudnn-shared}" ab_bench verify
fi
if has rows; then
  # The labelled rows picked for the loss with a scatter back (train::select_unique_rows, no
  # index_add): its test and the step's, then the drafter step with a profile.
  step rows
  fixtures rows dflash
  gtests rows '*SelectUniqueRows*:*HeadLoss*:*DrafterGpu*:*DrafterParity*:*TrainLoop*'
  "$dflash" bench-drafter --device cuda --json "$out/bench_drafter_rows.json" \
    --profile "$out/drafter_trace_rows.json" 2>&1 | tee "$out/bench_drafter_rows.txt" \
    | grep -v "^ .*\] " | head -40
  gzip -f "$out/drafter_trace_rows.json" "$out/drafter_trace_rows.online.json"
fi
if has pretrain; then
  # Training the target itself on CUDA: bf16 compute over fp32 masters against transformers'
  # gradients (fixture: pretrain), then a short `dflash pretrain` on GSM8K (.deps/gsm8k, copied
  # there by hand from ../shared/data/gsm8k) for its speed.
  step pretrain
  fixtures pretrain pretrain
  gtests pretrain '*Pretrain*'
  "$dflash" pretrain --data "$root/.deps/gsm8k/train.jsonl" --eval-data "$root/.deps/gsm8k/test.jsonl" \
    --out /tmp/pretrain-speed --layers 10 --hidden 384 --heads 6 --kv-heads 2 --ffn 1024 \
    --steps 200 --batch-size 64 --lr 2e-3 --log-seconds 5 2>&1 | tee "$out/pretrain_speed.txt"
fi
if has gsm8k; then
  # The end-to-end run on real text (examples/gsm8k/run.sh --full, docs/EXAMPLE_GSM8K.md).
  # GSM8K_STAGES splits it over device calls (runs/ stays on a warm machine), e.g.
  # GSM8K_STAGES=pretrain,generate then GSM8K_STAGES=prepare,train,eval.
  step gsm8k
  # GSM8K_TIMEOUT (seconds) stops it early enough that what it wrote still comes back.
  # GSM8K_TARGET=qwen3_5: the hybrid target (issue 35).
  gsm8k_target=${GSM8K_TARGET:-qwen3}
  gsm8k_out=$root/runs/gsm8k-full-$gsm8k_target
  timeout "${GSM8K_TIMEOUT:-0}" bash "$root/examples/gsm8k/run.sh" --full \
    --target "$gsm8k_target" --data "$root/.deps/gsm8k" --dflash "$dflash" \
    --out "$gsm8k_out" --stages "${GSM8K_STAGES:-pretrain,generate,prepare,train,eval}" \
    > "$out/gsm8k_full.log" 2>&1
  echo "gsm8k exit $?"; grep -E "^(gsm8k|=== )" "$out/gsm8k_full.log"
  for f in summary.json eval.json seconds.txt pretrain.log generate.log train.log \
    drafter/metrics.jsonl drafter/best.json; do
    cp "$gsm8k_out/$f" "$out/gsm8k_${f//\//_}" 2>/dev/null
  done
fi
if has gsm8k_packed; then
  # A run trained in an earlier call or session (scripts/pack_gsm8k_run.py's parts, carried as
  # .runpack) unpacked where the gsm8k stage leaves its run, the exported drafter as
  # drafter/best: gsm8k_serving then evaluates it without retraining.
  step gsm8k_packed
  run=$root/runs/gsm8k-full-${GSM8K_TARGET:-qwen3}
  rm -rf "$run" && mkdir -p "$run/drafter"
  cat "$root"/.runpack/run.tar.xz.* | tar xJf - -C "$run" && mv "$run/export" "$run/drafter/best"
  ls "$run" "$run/drafter/best"
fi
if has gsm8k_serving; then
  # Issue 37's GSM8K figures on a trained run (the gsm8k stage's, same --out): speculative
  # decoding in bf16 on the held-out questions at batch 1 and 16, and beside it on the first
  # GSM8K_PEER_PROMPTS (30) the z-lab-style Python decoder (bench/zlab_peer_decode.py, which
  # reads `dflash export`'s directory) and `dflash eval` on the same prompts.
  step gsm8k_serving
  run=$root/runs/gsm8k-full-${GSM8K_TARGET:-qwen3}
  "$dflash" export "$run/drafter/best" "$run/export" > "$out/gsm8k_export.log" 2>&1 ||
    tail -5 "$out/gsm8k_export.log"
  peer_n=${GSM8K_PEER_PROMPTS:-30}
  head -n "$peer_n" "$run/heldout.jsonl" > "$run/heldout_peer.jsonl"
  serve_eval() {  # NAME PROMPTS BATCH
    "$dflash" eval --json --target "$run/target" --drafter "$run/drafter/best" \
      --prompts "$2" --batch-size "$3" --enable-thinking false --device cuda --dtype bf16 \
      --max-new-tokens 384 > "$out/gsm8k_serving_$1.json" 2> "$out/gsm8k_serving_$1.err"
    python3 - "$out/gsm8k_serving_$1.json" "$1" <<'PY' || tail -5 "$out/gsm8k_serving_$1.err"
import json, sys
f = json.load(open(sys.argv[1]))["files"][0]
print(f"{sys.argv[2]}: tau {f['tau']:.3f}, {f['target_tokens_per_s']:.0f} -> "
      f"{f['speculative_tokens_per_s']:.0f} tokens/s, speed-up {f['speedup']:.2f}x, "
      f"{f['mismatches']} mismatches, {f['ties']} ties")
PY
  }
  serve_eval batch1 "$run/heldout.jsonl" 1
  serve_eval batch16 "$run/heldout.jsonl" 16
  # GSM8K_PACK=1: the run packed under $out for a later gsm8k_packed (carry the parts as .runpack).
  if [ "${GSM8K_PACK:-0}" = 1 ]; then python3 "$root/scripts/pack_gsm8k_run.py" "$run" "$out"; fi
  if [ "$peer_n" -gt 0 ]; then  # GSM8K_PEER_PROMPTS=0: no peer
    serve_eval peer_prompts_batch1 "$run/heldout_peer.jsonl" 1
    python3 "$root/bench/zlab_peer_decode.py" --target "$run/target" --export "$run/export" \
      --prompts "$run/heldout_peer.jsonl" --max-new-tokens 384 --json "$out/gsm8k_peer.json" \
      > "$out/gsm8k_peer.log" 2>&1
    grep -E "^zlab-style peer" "$out/gsm8k_peer.log" || tail -5 "$out/gsm8k_peer.log"
  fi
fi
if has tokenizer && [ -d "$root/.deps/bench" ]; then
  # Tokenizer throughput on a quiet many-core machine: the fixture tokenizers and GSM8K text
  # travel in .deps/bench (copied there by hand from build-text/fixtures and ../shared).
  step tokenizer
  BUILD_DIR=$build GSM8K=$root/.deps/bench/gsm8k WORK=/tmp/bench-text \
    DFLASH_PYTHON=$(command -v python3) FIXTURES=$root/.deps/bench/fx \
    BENCH_CXXFLAGS="-I$root/.deps/root/usr/include -L$root/.deps/root/usr/lib/x86_64-linux-gnu -Wl,-rpath,$root/.deps/root/usr/lib/x86_64-linux-gnu" \
    bash "$root/bench/run_tokenizer_bench.sh" 16 2>&1 | tee "$out/tokenizer_bench.txt"
fi
if has moe; then
  # Qwen3 MoE targets: the MoE tests on CUDA (grouped bf16 experts against the per-expert loop,
  # fp32 and bf16 against transformers, the decode path of a few rows, KV cache), then the
  # Qwen3-30B-A3B shape with random weights: prefill (issue 12 asks >= 40K tokens/s at 2048
  # tokens; TFLOP/s on active parameters, peak memory), the drafter step on its features, and
  # the whole pipeline on one GPU.
  step moe
  fixtures moe models
  gtests moe '*Moe*:*TargetParity*:*FusedDecode*:*KVCache*'
  # tiny-moe through random-model, prepare, train, export and eval in bf16 (the generator's
  # CUDA graph captures the grouped experts).
  python3 "$root/tests/cli/moe_cli.py" "$dflash" cuda > "$out/moe_cli.log" 2>&1
  echo "moe_cli exit $?"; tail -5 "$out/moe_cli.log"
  "$dflash" bench-target --preset qwen3-30b-a3b --device cuda --seq-len 2048 --batches 1,4 \
    --warmup 3 --iters 10 --json "$out/bench_target_moe.json" \
    --profile "$out/target_moe_trace.json" 2>&1 | tee "$out/bench_target_moe.txt"
  gzip -f "$out/target_moe_trace.json"
  "$dflash" bench-drafter --preset qwen3-30b-a3b --device cuda \
    --json "$out/bench_drafter_moe.json" 2>&1 | tee "$out/bench_drafter_moe.txt"
  "$dflash" bench --preset qwen3-30b-a3b --steps 20 --warmup 5 --json "$out/bench_moe.json" \
    2>&1 | grep -v "^train:" | tee "$out/bench_moe.txt"
fi
step done
# The device tool brings back a handful of files: everything travels in one archive.
(cd "$out" && tar czf ../gpu-out.tgz . && rm -rf ./* && mv ../gpu-out.tgz all.tgz)
