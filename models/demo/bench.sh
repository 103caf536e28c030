#!/usr/bin/env bash
# τ and speed of the demo pair on held-out prompts (bench/prompts.jsonl), all modes side by side in one run.
# Usage: models/demo/bench.sh TARGET DRAFTER OUT_JSON [DTYPE]
set -euo pipefail
python -m ddtree.cli bench --target "$1" --drafter "$2" --budgets 8,32,128 --num-prompts 24 --max-new-tokens 96 \
  --dtype "${4:-bfloat16}" --out "$3" 2>&1 | tr '\r' '\n' | grep -v "it/s"
