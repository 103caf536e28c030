"""Long prompts through running gateways, side by side: time to the first token and to the last of a few, per
gateway (e.g. two gateways in front of the same services, with different `--max-step-tokens`).

    python bench/long_prompt_ttft.py --gateways http://127.0.0.1:8011,http://127.0.0.1:8012 \
        --lengths 1800,7000 --repeat 3 --max-tokens 8 --out long_prompt_ttft.json

Requests alternate between the gateways (one at a time, greedy, ddtree mode), so both see the same machine
state. Each prompt is a fresh text (no prefix in common with the last: nothing cached could help) of about
the asked length; its exact token count comes from the gateway's usage. The first token waits for the whole
prefill (its chunks over as many steps); the second for the drafter's context too (all the prompt's features), so
both are reported, with where the rounds' time went.
Each gateway's first request of a length is reported apart (`first_of_its_length`, not in the medians): it may
size caches or capture graphs for the longer context.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from ddtree.bench_gateway import read_counters, served_model

WORDS = ("river", "stone", "light", "paper", "garden", "window", "silver", "music", "number", "morning", "yellow",
         "engine", "circle", "market", "winter", "bridge", "letter", "forest", "pocket", "summer")


def prompt_text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


TTFT = "ddtree_time_to_first_token_seconds_sum"
DRAFTS = "ddtree_spec_drafts_total"


def timed_request(url: str, model: str, text: str, max_tokens: int) -> dict:
    """One chat request -> the gateway's time to its first token (from its metrics: random weights make tokens
    that decode to no text, so a client could not see it), the client's time to the whole answer, and the
    prompt's token count."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "speculation": {"mode": "ddtree"}}
    before = read_counters(url)
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    last = time.perf_counter() - start
    if reply.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text}")
    usage = reply.json()["usage"]
    after = read_counters(url)
    # where the rounds' time went (gateway/metrics.py PHASES) and how many rounds drafted
    rounds = {name: after[name] - before[name] for name in after if name.startswith("phase[")}
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "first_s": after[TTFT] - before[TTFT], "last_s": last, "rounds_s": rounds,
            "drafts": after[DRAFTS] - before[DRAFTS]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateways", required=True, help="comma-separated gateway URLs")
    p.add_argument("--lengths", default="1800,7000",
                   help="prompt lengths to try, in words (the demo tokenizer makes ~2.3 tokens of a word)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    urls = [u.rstrip("/") for u in args.gateways.split(",")]
    model = {served_model(url) for url in urls}.pop()  # every stack speculating before any is timed
    rng = random.Random(0)
    results: dict[str, dict[int, list[dict]]] = {u: {} for u in urls}
    first: dict[str, dict[int, dict]] = {u: {} for u in urls}
    for length in map(int, args.lengths.split(",")):
        for url in urls:  # warm-up, kept apart: the first request of a length may size caches or capture graphs
            first[url][length] = timed_request(url, model, prompt_text(length, rng), args.max_tokens)
            print(f"{url} {length} (first of its length): {first[url][length]}", flush=True)
        for rep in range(args.repeat):
            for url in urls if rep % 2 == 0 else urls[::-1]:
                r = timed_request(url, model, prompt_text(length, rng), args.max_tokens)
                results[url].setdefault(length, []).append(r)
                print(f"{url} {length}: {r}", flush=True)
    summary = {
        url: {length: {"prompt_tokens": runs[0]["prompt_tokens"],
                       "first_token_s": statistics.median(r["first_s"] for r in runs),
                       "last_token_s": statistics.median(r["last_s"] for r in runs),
                       "runs": runs, "first_of_its_length": first[url][length]}
              for length, runs in by_length.items()}
        for url, by_length in results.items()
    }
    for url, by_length in summary.items():
        for length, s in by_length.items():
            print(f"{url}  {s['prompt_tokens']} tokens: first {s['first_token_s'] * 1000:.1f} ms, "
                  f"last of {args.max_tokens} {s['last_token_s'] * 1000:.1f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "gateways": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
