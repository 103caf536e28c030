#!/usr/bin/env bash
# Rebuilds the bundled demo pair from scratch on one GPU (the H200 run that produced models/demo took < 10 min):
# the stdlib corpus + BPE tokenizer + Qwen3-architecture target, then its DFlash drafter, then the τ benchmark
# on held-out prompts. Usage: models/demo/train.sh OUT_DIR [WORK_DIR]
set -euo pipefail
out=${1:?usage: train.sh OUT_DIR [WORK_DIR]}
work=${2:-/tmp/ddtree-demo-work}
mkdir -p "$out" "$work"
ddtree() { python -m ddtree.cli "$@"; }

ddtree train-target --out "$work/target" --work-dir "$work/target.work" --device cuda --dtype bfloat16 \
  --steps 600 --batch-size 64 --seq-len 1024 --max-minutes 3 --no-progress 2>&1 | tail -c 8000 > "$out/target_log.txt"
(cd "$work" && tar cf - target | split -b 15M - "$out/target.tar.part-")

# the drafter learns what the TARGET answers (greedy), on training prompts only: held-out prompts stay unseen
ddtree distill-corpus --target "$work/target" --corpus "$work/target.work/corpus/train.jsonl" \
  --out "$work/distill.jsonl" --num-prompts 8000 --max-new-tokens 256 --batch-size 512 2>&1 | tail -1 > "$out/distill_log.txt"

ddtree train-drafter --target "$work/target" --corpus "$work/distill.jsonl" --out "$work/drafter" \
  --device cuda --block-size 16 --num-layers 2 --tap-layers 1,3,5 --steps 5000 --batch-size 32 --window 512 \
  --blocks-per-window 16 --lr 6e-4 --max-minutes 3.5 2>&1 | tr '\r' '\n' | tail -c 8000 > "$out/drafter_log.txt"
rm -f "$work/drafter/train_state.pt"; rm -rf "$work/drafter/cache"
(cd "$work" && tar cf "$out/drafter.tar" drafter)

