#!/usr/bin/env bash
# Speed under speculation at a real architecture's shapes with real acceptance: the demo pair embedded in SHAPE
# (`ddtree embed-pair`), then measured on one GPU in bf16, each step writing OUT/SHAPE_*.json:
#   inprocess  `ddtree bench`: ar, chain and ddtree at BUDGETS side by side in one process
#   services   `ddtree serve` on the embedded pair, then `ddtree bench --gateway` over the same prompts
#   load       concurrent chat clients through the same `ddtree serve` (bench/concurrent_load.py, CLIENTS)
#   curve      the cost curve's AR step and verify(N) of the fastest verifier path (random weights, same shapes)
# usage: bench/real_shapes.sh SHAPE OUT [STEPS] ; env PAIR (where the pair is written, default /tmp/pair-SHAPE),
# PROMPTS (default 16), MAX_NEW (default 256), BUDGETS (default 16,32,64,128), EXTRA (more `ddtree bench` flags),
# CLIENTS (default 1,4,16), MAX_BATCH (the verifier's, default 16), DEVICE (default cuda), PORT (default 8000)
set -euo pipefail
shape=$1 out=$2 steps=${3:-inprocess,services,load,curve}
pair=${PAIR:-/tmp/pair-$shape} prompts=${PROMPTS:-16} max_new=${MAX_NEW:-256} budgets=${BUDGETS:-16,32,64,128}
ddtree=(python3 -m ddtree.cli)
mkdir -p "$out"
stamp() { echo "[real-shapes $(date +%T)] $*"; }

if [[ ! -f $pair/embedding.json ]]; then
  stamp "embedding the demo pair in $shape -> $pair"
  "${ddtree[@]}" embed-pair --shape "$shape" --out "$pair" --dtype bfloat16
fi
common=(--budgets "$budgets" --num-prompts "$prompts" --max-new-tokens "$max_new")

if [[ ,$steps, == *,inprocess,* ]]; then
  stamp "in-process bench"
  # shellcheck disable=SC2086 # EXTRA is a list of flags
  "${ddtree[@]}" bench --target "$pair/target" --drafter "$pair/drafter" --dtype bfloat16 --compile ${EXTRA:-} \
    "${common[@]}" --out "$out/${shape}_inprocess.json"
fi

if [[ ,$steps, == *,services,* || ,$steps, == *,load,* ]]; then
  port=${PORT:-8000} verify_metrics=$(( ${PORT:-8000} + 1462 )) draft_metrics=$(( ${PORT:-8000} + 1461 ))
  stamp "ddtree serve on the pair (API :$port, metrics :$verify_metrics, :$draft_metrics)"
  "${ddtree[@]}" serve --target "$pair/target" --drafter "$pair/drafter" --device "${DEVICE:-cuda}" --dtype bfloat16 \
    --port "$port" --max-batch "${MAX_BATCH:-16}" --verify-metrics-port "$verify_metrics" \
    --draft-metrics-port "$draft_metrics" > "$out/${shape}_serve.log" 2>&1 &
  serve=$!
  trap 'kill -INT $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
  if [[ ,$steps, == *,services,* ]]; then
    stamp "services bench"
    "${ddtree[@]}" bench --gateway "http://127.0.0.1:$port" "${common[@]}" --out "$out/${shape}_services.json"
  fi
  if [[ ,$steps, == *,load,* ]]; then
    stamp "concurrent load"
    python3 -c "from ddtree.bench_gateway import served_model; served_model('http://127.0.0.1:$port')"  # ready
    python3 bench/concurrent_load.py --gateways "http://127.0.0.1:$port" \
      --verifier-metrics "http://127.0.0.1:$verify_metrics" --drafter-metrics "http://127.0.0.1:$draft_metrics" \
      --clients "${CLIENTS:-1,4,16}" --requests-per-client 3 --max-tokens 64 --out "$out/${shape}_load.json"
  fi
fi

if [[ ,$steps, == *,curve,* ]]; then
  stamp "cost curve"
  "${ddtree[@]}" bench --cost-curve "$shape" --device cuda --dtype bfloat16 --repeat 10 --sizes "${SIZES:-15,63}" \
    --paths "${PATHS_CURVE:-fused+graphs+compile+flash+gemv}" --out "$out/${shape}_curve.json"
fi
stamp done
