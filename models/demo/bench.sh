#!/usr/bin/env bash
# τ, speed and exactness of the demo pair on the 40 held-out prompts (bench/prompts.jsonl), up to 256 new tokens
# each, all modes side by side in one run (a GPU: the steps are compiled). fp32 checks exactness: every mode's
# output must equal AR's; bf16 measures speed.
# Usage: models/demo/bench.sh TARGET DRAFTER OUT_JSON [DTYPE]
set -euo pipefail
python -m ddtree.cli bench --target "$1" --drafter "$2" --budgets 32,64 --num-prompts 40 --max-new-tokens 256 \
  --dtype "${4:-bfloat16}" --compile --out "$3" 2>&1 | tr '\r' '\n' | grep -v "it/s"
