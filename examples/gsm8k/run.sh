#!/usr/bin/env bash
# The end-to-end run on real text (docs/EXAMPLE_GSM8K.md): a Qwen3 target trained here on the
# GSM8K train questions and answers (`dflash pretrain`), its greedy answers to those questions
# (`dflash generate`), a DFlash drafter trained on them (`dflash prepare`, `dflash train`,
# B = 16), and real speculative decoding on GSM8K test questions that no stage trained on
# (`dflash eval`, which also checks that the output is the target's own greedy output).
#
# Usage: examples/gsm8k/run.sh [--mini | --full] [--target ARCH] [--data DIR] [--out DIR]
#                               [--dflash BINARY] [--stages LIST]
#   --mini (default)  CPU: a 1.4M-parameter target, part of the data (2-core machine)
#   --full            one GPU: a 16.5M-parameter target on all of GSM8K, 500 held-out questions
#   --target ARCH     qwen3 (default), or qwen3_5: a Qwen3.5-shaped hybrid target (Gated
#                     DeltaNet layers, gated attention every 4th layer), same widths, or
#                     gpt_oss: a gpt-oss-shaped target (sliding/full attention with sinks, 4
#                     experts top 2) chatting in harmony (the template beside the data:
#                     DIR/../chat_templates/openai-gpt-oss-120b.jinja); smaller in --mini
#   --data DIR        holds GSM8K train.jsonl and test.jsonl (default: ../shared/data/gsm8k)
#   --out DIR         work directory (default: runs/gsm8k-MODE); pretrain starts it afresh
#   --dflash BINARY   default: $BUILD_DIR/src/dflash, else build/src/dflash
#   --stages LIST     a comma-separated part of pretrain,generate,prepare,train,eval (default:
#                     all), to split the run over several calls with the same --out
# Prints each stage's wall time, the target's validation loss and tau; writes OUT/summary.json.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mode=mini
target=qwen3
stages=pretrain,generate,prepare,train,eval
data=""
out=""
dflash=${BUILD_DIR:-$root/build}/src/dflash
while [ $# -gt 0 ]; do
  case "$1" in
    --mini) mode=mini ;;
    --full) mode=full ;;
    --target) target=$2; shift ;;
    --data) data=$2; shift ;;
    --out) out=$2; shift ;;
    --dflash) dflash=$2; shift ;;
    --stages) stages=$2; shift ;;
    *) sed -n '8,23p' "$0"; exit 2 ;;
  esac
  shift
done
if [ -z "$data" ]; then
  for d in "$root/../shared/data/gsm8k" "$root/.deps/gsm8k"; do
    [ -f "$d/train.jsonl" ] && data=$d && break
  done
fi
if [ ! -f "$data/train.jsonl" ] || [ ! -f "$data/test.jsonl" ]; then
  echo "run.sh: GSM8K train.jsonl and test.jsonl not found (pass --data DIR)" >&2
  exit 1
fi
case "$target" in
  qwen3) out=${out:-$root/runs/gsm8k-$mode} ;;
  qwen3_5 | gpt_oss) out=${out:-$root/runs/gsm8k-$mode-$target} ;;
  *) echo "run.sh: --target must be qwen3, qwen3_5 or gpt_oss, got '$target'" >&2; exit 2 ;;
esac
harmony=$data/../chat_templates/openai-gpt-oss-120b.jinja
if [ "$target" = gpt_oss ] && [ ! -f "$harmony" ]; then
  echo "run.sh: --target gpt_oss needs gpt-oss' chat template at $harmony" >&2
  exit 1
fi
has() { [[ ",$stages," == *",$1,"* ]]; }
# A stage starts from nothing (generate resumes by itself: it skips the lines it has written).
if has pretrain; then rm -rf "$out"; fi
if has prepare; then rm -rf "$out/data"; fi
if has train; then rm -rf "$out/drafter"; fi
mkdir -p "$out"

if [ "$mode" = mini ]; then
  device=cpu
  # Two cores: one thread each for the few small matrices beats two threads contending.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  pretrain=(--layers 6 --hidden 128 --heads 4 --kv-heads 2 --ffn 384 --steps 600
            --batch-size 8 --lr 1e-2 --max-eval-samples 200)
  questions=400        # train questions the target answers for the drafter
  samples=0            # sampled answers per question beside the greedy one
  generate=(--max-new-tokens 160 --batch-size 64)
  drafter=(--drafter-layers 2 --steps 150 --batch-size 8 --max-anchors 64 --lr 3e-3)
  # tau during training on the first 20 held-out questions (a few seconds in all)
  train_eval=(--eval-every 50 --eval-max-new-tokens 160 --eval-batch-size 8)
  heldout=40
  validation=20
  eval=(--max-new-tokens 160 --batch-size 8)
else
  device=cuda
  # 5 target epochs, not more: the longer the target trains, the closer its answers to train
  # questions come to the memorised GSM8K text, unlike its answers to new questions, and the
  # lower the drafter's tau on those (validation tau after 2 drafter epochs: 4.84 with 5 target
  # epochs, 4.00 with 7, 3.22 with 10; scripts/gsm8k_variants.sh, docs/EXAMPLE_GSM8K.md).
  pretrain=(--layers 10 --hidden 384 --heads 6 --kv-heads 2 --ffn 1024
            --epochs "${GSM8K_TARGET_EPOCHS:-5}"
            --batch-size 64 --lr 2e-3 --eval-every 200)
  questions=0          # all 7473
  # Three answers sampled at temperature 0.7 per question beside the greedy one: four times
  # the data from the target's own distribution. On the greedy answers alone the drafter
  # overfit (tau 3.34 after 8.5 epochs, 3.18 after 16); on all four, 3 epochs (5,604 steps)
  # still gained at the end, and 5 (9,340 steps) reach the plateau: validation tau 5.80 from
  # step 7,500 on, 5.75 on the 500 held-out questions (5.47 after 3 epochs).
  samples=${GSM8K_SAMPLES:-3}
  temperature=0.7
  generate=(--max-new-tokens 384 --batch-size 256)
  drafter=(--drafter-layers 5 --epochs "${GSM8K_DRAFTER_EPOCHS:-5}" --batch-size 16
           --max-anchors 512)
  train_eval=(--eval-every 500 --eval-max-new-tokens 384 --eval-batch-size 32)
  heldout=500
  validation=100
  # fp32: this small model's bf16 logits tie exactly often enough (103 of 500 answers in a bf16 run)
  # that a verify pass and a decode step, which round differently, pick different tokens.
  # (64 at a time was no faster: it had not finished 500 questions after 196 s)
  eval=(--max-new-tokens 384 --batch-size 16 --dtype fp32)
fi
if [ "$target" = qwen3_5 ]; then
  # Three Gated DeltaNet layers to one of gated attention, as Qwen3.5. Heads of 128 on the GPU
  # (what our kernels and Qwen3.5 have); 32 on the CPU, where every size takes the reference.
  head_dim=128
  if [ "$mode" = mini ]; then head_dim=32; fi
  pretrain+=(--arch qwen3_5 --full-attention-interval 4 --linear-key-heads 2
             --linear-value-heads 4 --linear-head-dim "$head_dim")
fi
if [ "$target" = gpt_oss ]; then
  # The harmony template and tokens (the built-in tokenizer plus harmony's specials); sliding
  # windows of 32 against answers of ~100-200 tokens after a ~100-token system message.
  if [ "$mode" = mini ]; then
    # CI's budget (a few minutes on 2 cores; harmony's system message doubles the tokens of a
    # chat, the experts loop on the CPU): a 3-layer target of width 64, fewer steps and
    # questions; the drafter taps layers 0 and 1 (not the last).
    pretrain=(--layers 3 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --steps 280
              --batch-size 8 --lr 1e-2 --max-eval-samples 50)
    questions=120
    drafter=(--drafter-layers 2 --target-layer-ids 0,1 --steps 64 --batch-size 8
             --max-anchors 64 --lr 3e-3)
    train_eval=(--eval-every 32 --eval-max-new-tokens 160 --eval-batch-size 8)
  fi
  pretrain+=(--arch gpt_oss --experts 4 --experts-per-token 2 --sliding-window 32
             --chat-template "$harmony")
fi

# Held out: the first `heldout` GSM8K test questions, for the final tau. The next `validation`
# ones are what tau during training is measured on, and the drafter kept (RUN/best) is the one
# with the highest tau there, so the final figure is on questions nothing was selected on.
# pretrain reads the test answers only for its validation loss; nothing trains on the test split.
head -n "$heldout" "$data/test.jsonl" > "$out/heldout.jsonl"
sed -n "$((heldout + 1)),$((heldout + validation))p" "$data/test.jsonl" > "$out/validation.jsonl"
if [ "$questions" -gt 0 ]; then
  head -n "$questions" "$data/train.jsonl" > "$out/questions.jsonl"
else
  cp "$data/train.jsonl" "$out/questions.jsonl"
fi

stage() {  # stage NAME command...: runs it if asked for (output in OUT/NAME.log), timed
  local name=$1 start=$EPOCHREALTIME
  shift
  has "$name" || return 0
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local s
  s=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  echo "$name=$s" >> "$out/seconds.txt"
  echo "=== $name: $s s"
}

stage pretrain "$dflash" pretrain --data "$data/train.jsonl" --eval-data "$data/test.jsonl" \
  --out "$out/target" --device "$device" "${pretrain[@]}"
# Greedy and without thinking: the prompt ends in the empty think block the target trained on.
answers=("$out/answers.jsonl")
for ((i = 1; i <= samples; i++)); do answers+=("$out/answers-sampled-$i.jsonl"); done
generate_all() {
  "$dflash" generate --target "$out/target" --data "$out/questions.jsonl" \
    --out "$out/answers.jsonl" --enable-thinking false --device "$device" "${generate[@]}"
  for ((i = 1; i <= samples; i++)); do
    "$dflash" generate --target "$out/target" --data "$out/questions.jsonl" \
      --out "$out/answers-sampled-$i.jsonl" --enable-thinking false --device "$device" \
      --temperature "$temperature" --seed "$i" "${generate[@]}"
  done
}
stage generate generate_all
stage prepare "$dflash" prepare --tokenizer "$out/target" --data "${answers[@]}" \
  --out "$out/data"
# GSM8K_TRAIN_ARGS: more `dflash train` options for experiments (ones the recipe does not set).
read -r -a train_extra <<< "${GSM8K_TRAIN_ARGS:-}"
stage train "$dflash" train --target "$out/target" --data "$out/data" --out "$out/drafter" \
  --block-size 16 --device "$device" "${drafter[@]}" --eval-prompts "$out/validation.jsonl" \
  "${train_eval[@]}" ${train_extra[@]+"${train_extra[@]}"}
eval_json() { "$dflash" eval --json "$@" > "$out/eval.json"; }
stage eval eval_json --target "$out/target" --drafter "$out/drafter/best" \
  --prompts "$out/heldout.jsonl" --enable-thinking false --device "$device" "${eval[@]}"
has eval || exit 0
"$dflash" export "$out/drafter/best" "$out/export"

python3 - "$out" "$mode" <<'PY'
import json, pathlib, sys
out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
seconds = {}
for line in (out / "seconds.txt").read_text().split():
    name, value = line.split("=")
    seconds[name] = float(value)
target = json.loads((out / "target" / "pretrain.json").read_text())
report = json.loads((out / "eval.json").read_text())
f = report["files"][0]
metrics = [json.loads(l) for l in (out / "drafter" / "metrics.jsonl").read_text().splitlines()]
train_tau = {l["step"]: l["eval_tau"] for l in metrics if "eval_tau" in l}
best = json.loads((out / "drafter" / "best.json").read_text())
arch = json.loads((out / "target" / "config.json").read_text())["model_type"]
summary = {"mode": mode, "target_arch": arch, "seconds": seconds,
           "total_seconds": sum(seconds.values()),
           "target": target, "eval": report, "train_eval_tau": train_tau, "best": best}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
hist = " ".join(f"{k}:{n}" for k, n in enumerate(f["committed_histogram"]) if k > 0)
print(f"gsm8k {mode}: target {arch} {target['params'] / 1e6:.2f}M params, validation loss "
      f"{target['eval_loss']:.4f} (answer tokens, {target['eval_samples']} test samples)")
print(f"gsm8k {mode}: tau {f['tau']:.3f} on {f['prompts']} held-out questions (B = "
      f"{f['block_size']}); committed per step {hist}")
print(f"gsm8k {mode}: tau during training (validation questions): " +
      ", ".join(f"step {s} {t:.3f}" for s, t in train_tau.items()) +
      f"; kept the drafter of step {best['step']}")
print(f"gsm8k {mode}: speed-up {f['speedup']:.2f}x (target-only {f['target_tokens_per_s']:.0f}, "
      f"speculative {f['speculative_tokens_per_s']:.0f} tokens/s); output == target greedy on "
      f"{f['turns'] - f['mismatches']}/{f['turns']}")
print(f"gsm8k {mode}: wall " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) +
      f"; total {sum(seconds.values()):.0f} s")
PY
