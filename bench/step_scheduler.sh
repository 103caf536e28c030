#!/usr/bin/env bash
# The step scheduler against per-request rounds, side by side on one GPU: `ddtree serve` stacks on the embedded pair
# of SHAPE (`ddtree embed-pair`), each with its own settings, loaded in turns by bench/concurrent_load.py
# (CLIENTS concurrent streaming clients, every mode of MODES at every temperature of TEMPERATURES), writing one
# OUT/SHAPE_steps.json and its figure OUT/SHAPE_steps.png; with CAPACITY=NxL, then bench/capacity.py on each stack
# (N requests of L tokens held at once), writing OUT/SHAPE_capacity_STACK.json.
#   steps       --batch-steps (the default): one DraftBatch and one VerifyBatch per step; drafts batched too; each
#               step's trees cut to the size its load verifies best (--fit-trees, the default)
#   steps-d1    the same with the drafter drafting one block at a time
#   cohorts     --step-cohorts 2: two cohorts stepping on their own, one's drafts beside the other's verifies
#   drafted     --no-fit-trees: each step verifies its trees as drafted, at the budget's size whatever the load
#   alone       --no-batch-steps --draft-max-batch 1: each request's calls go alone and meet by chance
#   prompts-alone  steps, with --prefill-batch-tokens 0: every prompt its own (captured) forward, none shared
# usage: bench/step_scheduler.sh SHAPE OUT ; env PAIR (default /tmp/pair-SHAPE), CLIENTS (default 1,4,16),
# MAX_TOKENS (default 64), REQUESTS (per client, default 3), MODES (default "off ddtree"), TEMPERATURES (default 0),
# CHECK_ALONE (1: each greedy answer against the same request alone), MAX_SESSIONS (each stack's --max-sessions and
# --max-running; default: theirs, 16), MAX_BATCH (the verifier's, default 16), CAPACITY (NxL, e.g. 128x2048;
# default: none), STACKS (the stacks to run, default "steps steps-d1 alone"), DEVICE (default cuda)
set -euo pipefail
shape=$1 out=$2
pair=${PAIR:-/tmp/pair-$shape}
ddtree=(python3 -m ddtree.cli)
mkdir -p "$out"
stamp() { echo "[step-scheduler $(date +%T)] $*"; }

if [[ ! -f $pair/embedding.json ]]; then
  stamp "embedding the demo pair in $shape -> $pair"
  "${ddtree[@]}" embed-pair --shape "$shape" --out "$pair" --dtype bfloat16
fi

declare -A flags=([steps]="--draft-max-batch 16" [steps-d1]="--draft-max-batch 1"
                  [cohorts]="--draft-max-batch 16 --step-cohorts 2" [drafted]="--draft-max-batch 16 --no-fit-trees"
                  [alone]="--no-batch-steps --draft-max-batch 1"
                  [prompts-alone]="--draft-max-batch 16 --prefill-batch-tokens 0")
read -ra names <<< "${STACKS:-steps steps-d1 alone}"
pids=() gateways=() verifiers=() drafters=()
trap 'for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null; done; wait' EXIT
for i in "${!names[@]}"; do
  port=$((8100 + 10 * i))
  # shellcheck disable=SC2086 # the stack's flags are a list
  "${ddtree[@]}" serve --target "$pair/target" --drafter "$pair/drafter" --device "${DEVICE:-cuda}" --dtype bfloat16 \
    --port "$port" --max-batch "${MAX_BATCH:-16}" --verify-metrics-port $((port + 1)) \
    --draft-metrics-port $((port + 2)) ${MAX_SESSIONS:+--max-sessions "$MAX_SESSIONS" --max-running "$MAX_SESSIONS"} \
    ${flags[${names[$i]}]} > "$out/${shape}_steps_${names[$i]}_serve.log" 2>&1 &
  pids+=($!)
  gateways+=("http://127.0.0.1:$port") verifiers+=("http://127.0.0.1:$((port + 1))")
  drafters+=("http://127.0.0.1:$((port + 2))")
done
join() { local IFS=,; echo "$*"; }
for url in "${gateways[@]}"; do
  python3 -c "from ddtree.bench_gateway import served_model; served_model('$url')"  # waits until it serves
done
stamp "stacks ${names[*]} serving at $(join "${gateways[@]}")"
modes=${MODES:-off ddtree}
stamp "load, modes $modes"
python3 bench/concurrent_load.py --gateways "$(join "${gateways[@]}")" --verifier-metrics "$(join "${verifiers[@]}")" \
  --drafter-metrics "$(join "${drafters[@]}")" --clients "${CLIENTS:-1,4,16}" --modes "${modes// /,}" \
  --temperatures "${TEMPERATURES:-0}" --requests "${REQUESTS:-3}" --max-tokens "${MAX_TOKENS:-64}" \
  ${CHECK_ALONE:+--check-alone} --out "$out/${shape}_steps.json"
if [[ -n ${CAPACITY:-} ]]; then
  for i in "${!names[@]}"; do
    stamp "capacity $CAPACITY, stack ${names[$i]}"
    python3 bench/capacity.py --gateway "${gateways[$i]}" --verifier-metrics "${verifiers[$i]}" \
      --drafter-metrics "${drafters[$i]}" --sessions "${CAPACITY%x*}" --context "${CAPACITY#*x}" \
      --modes "${modes// /,}" --out "$out/${shape}_capacity_${names[$i]}.json"
  done
fi
stamp done
