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
  --steps 2000 --batch-size 64 --seq-len 1024 --max-minutes 4.5 --no-progress 2>&1 | tail -c 8000 > "$out/target_log.txt"

ddtree train-drafter --target "$work/target" --corpus "$work/target.work/corpus/train.jsonl" --out "$work/drafter" \
  --device cuda --block-size 16 --num-layers 2 --tap-layers 1,3,5 --steps 2000 --batch-size 32 --window 512 \
  --blocks-per-window 16 --lr 6e-4 --max-minutes 3 2>&1 | tr '\r' '\n' | tail -c 8000 > "$out/drafter_log.txt"
rm -f "$work/drafter/train_state.pt"; rm -rf "$work/drafter/cache"

ddtree bench --target "$work/target" --drafter "$work/drafter" --budgets 8,32,128 --max-new-tokens 128 \
  --dtype bfloat16 --out "$out/bench_demo_bf16.json" 2>&1 | tr '\r' '\n' | grep -v "it/s" | tail -20 > "$out/bench_log.txt"
