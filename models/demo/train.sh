#!/usr/bin/env bash
# Rebuilds the bundled demo pair from scratch in ONE ≤10-minute command on one GPU (planned for ~8 min on an
# H200): the stdlib corpus + BPE tokenizer + Qwen3-architecture target, the target's own answers to every
# training prompt, then the DFlash drafter. Usage: models/demo/train.sh OUT_DIR [WORK_DIR]
# OUT_DIR gets only what must come back from the GPU machine: target.tar.part-* (each < 16 MiB), drafter.tar
# and the three logs; the corpus, the distilled answers and the checkpoints stay in WORK_DIR.
set -euo pipefail
out=${1:?usage: train.sh OUT_DIR [WORK_DIR]}
work=${2:-$(mktemp -d)}
mkdir -p "$out" "$work"
ddtree() { python -m ddtree.cli "$@"; }
# --max-minutes for a stage that must end by second $1 of this script: every stage stops cleanly in time (and
# still writes its result) on a slower machine, so the whole script stays inside the 10-minute limit.
by() {
  local s=$(($1 - SECONDS))
  ((s >= 6)) || s=6
  printf '%d.%02d' $((s / 60)) $((s % 60 * 100 / 60))
}
stamp() { echo "train.sh: $1 done at ${SECONDS}s" >> "$2"; }
export TQDM_MININTERVAL=5  # a progress line every 5 s: the logs keep the speed without one line per step

# Target: the 7 M-token corpus is memorised long before a long schedule ends (a 600-step run:
# held-out loss 2.99 at step 250, 3.22 at 600), and a memorising target answers training prompts by rote but
# held-out ones not, so its drafter would learn behaviour it never meets. 300 steps, evaluated every 25, and the
# weights with the lowest held-out loss are the ones exported.
ddtree train-target --out "$work/target" --work-dir "$work/target.work" --device cuda --dtype bfloat16 \
  --steps 300 --batch-size 64 --seq-len 1024 --save-every 25 --keep-best --max-minutes "$(by 150)" \
  --no-progress 2>&1 | tail -c 8000 > "$out/target_log.txt"
stamp target "$out/target_log.txt"
(cd "$work" && tar cf - target | split -b 15M - "$out/target.tar.part-")

# Drafter data: the target's greedy answers to EVERY training prompt (what a T=0 drafter must predict), plus one
# sampled answer each (T=0.7: mostly the greedy path, branching into contexts the greedy answers never reach).
# Held-out prompts are never trained on: the target's answers to them only measure the drafter (--eval-corpus).
corpus="$work/target.work/corpus"
distill=(--target "$work/target" --max-new-tokens 256 --batch-size 4096 --batch-tokens 2097152)
ddtree distill-corpus "${distill[@]}" --corpus "$corpus/train.jsonl" --out "$work/distill-greedy.jsonl" \
  --max-minutes "$(by 240)" 2>&1 | tr '\r' '\n' | tail -n 2 > "$out/distill_log.txt"
ddtree distill-corpus "${distill[@]}" --corpus "$corpus/train.jsonl" --out "$work/distill-sampled.jsonl" \
  --temperature 0.7 --seed 1 --max-minutes "$(by 320)" 2>&1 | tr '\r' '\n' | tail -n 2 >> "$out/distill_log.txt"
ddtree distill-corpus "${distill[@]}" --corpus "$corpus/heldout.jsonl" --out "$work/heldout-answers.jsonl" \
  --max-minutes "$(by 340)" 2>&1 | tr '\r' '\n' | tail -n 2 >> "$out/distill_log.txt"
cat "$work/distill-greedy.jsonl" "$work/distill-sampled.jsonl" > "$work/distill.jsonl"
stamp distillation "$out/distill_log.txt"

# Drafter: 3 layers (10.3 MB in bf16, so the pair stays under 40 MB), block 16, taps = target layers 1, 3, 5.
# A step of this small drafter is bound by kernel launches, so 128 windows cost little more than 32 did.
ddtree train-drafter --target "$work/target" --corpus "$work/distill.jsonl" \
  --eval-corpus "$work/heldout-answers.jsonl" --out "$work/drafter" --device cuda --block-size 16 \
  --num-layers 3 --tap-layers 1,3,5 --steps 6000 --batch-size 128 --window 512 --blocks-per-window 16 \
  --lr 1e-3 --warmup-steps 200 --max-minutes "$(by 540)" 2>&1 | tr '\r' '\n' | tail -c 12000 > "$out/drafter_log.txt"
rm -f "$work/drafter/train_state.pt"
rm -rf "$work/drafter/cache"
(cd "$work" && tar cf "$out/drafter.tar" drafter)
stamp drafter "$out/drafter_log.txt"
