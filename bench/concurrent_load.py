"""Concurrent chat clients through running gateways, side by side: aggregate tokens/s and request latency as the
number of clients grows (e.g. two `ddtree serve` stacks on one GPU, one with `--max-batch 1`).

    python bench/concurrent_load.py --gateways http://127.0.0.1:8011,http://127.0.0.1:8021 \
        --verifier-metrics http://127.0.0.1:9472,http://127.0.0.1:9482 --clients 1,2,4,8 \
        --requests-per-client 3 --max-tokens 64 --out concurrent_load.json

At each client count the gateways take turns (the order alternating), so both see the same machine state. Each
client sends its requests one after another (greedy unless --temperature, the given speculation mode, a fresh
short prompt each); every client starts at once. Reported per gateway and client count: completion tokens / wall
time, the median and worst request latency (every latency, in the order the requests ended, in the JSON), and,
with --verifier-metrics, the mean number of sessions' rounds the verifier ran in one forward
(ddtree_verify_batch_size) and its forwards per second; with --drafter-metrics, the drafter's mean blocks a forward
(ddtree_draft_batch_size). The JSON also holds each level's mean time a round spent in each phase, from the gateway's
own metrics (ddtree_round_phase_seconds: draft, tree, verify, walk, server, transport, relay), which shows which side a
setting moves (e.g. with `--draft-max-batch`: whether the draft phase grows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ddtree.bench_gateway import read_counters, served_model
from gateway.metrics import PHASES

WORDS = ("river", "stone", "light", "paper", "garden", "window", "silver", "music", "number", "morning", "yellow",
         "engine", "circle", "market", "winter", "bridge", "letter", "forest", "pocket", "summer")
def batch_counters(url: str | None, histogram: str) -> tuple[float, float]:
    """A service's batch-size histogram (ddtree_verify_batch_size, ddtree_draft_batch_size): (calls, forwards) so
    far; (0, 0) without a URL."""
    if url is None:
        return 0.0, 0.0
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name in (f"{histogram}_sum", f"{histogram}_count")}
    return values.get(f"{histogram}_sum", 0.0), values.get(f"{histogram}_count", 0.0)


async def client(http: httpx.AsyncClient, url: str, model: str, prompts: list[str], args: argparse.Namespace,
                 latencies: list[float]) -> int:
    tokens = 0
    for text in prompts:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": args.max_tokens,
                "temperature": args.temperature, "speculation": {"mode": args.mode}}
        start = time.perf_counter()
        reply = await http.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        latencies.append(time.perf_counter() - start)
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text}")
        tokens += reply.json()["usage"]["completion_tokens"]
    return tokens


async def load(url: str, metrics: tuple[str | None, str | None], model: str, clients: int,
               args: argparse.Namespace, rng: random.Random) -> dict:
    """metrics: the gateway's verifier's and drafter's metrics URLs (None: not read)."""
    prompts = [[" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(args.requests_per_client)]
               for _ in range(clients)]
    latencies: list[float] = []
    histograms = ("ddtree_verify_batch_size", "ddtree_draft_batch_size")
    before = [batch_counters(url, histogram) for url, histogram in zip(metrics, histograms)]
    counters_before = read_counters(url)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 1)) as http:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(client(http, url, model, p, args, latencies) for p in prompts))
        wall = time.perf_counter() - start
    counters = read_counters(url)
    level = {name: value - counters_before.get(name, 0.0) for name, value in counters.items()}  # this level's only
    (calls, forwards), (drafts, blocks) = (
        (after[0] - was[0], after[1] - was[1])
        for after, was in zip((batch_counters(url, histogram) for url, histogram in zip(metrics, histograms)), before)
    )
    return {"clients": clients, "tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall,
            "latency_median_s": statistics.median(latencies), "latency_max_s": max(latencies),
            "mean_batch": calls / forwards if forwards else None, "forwards_per_s": forwards / wall,
            "mean_draft_batch": drafts / blocks if blocks else None,
            "round_phase_ms": {phase: round(level[f"phase[{phase}]"] / level[f"rounds[{phase}]"] * 1000, 3)
                               for phase in PHASES if level.get(f"rounds[{phase}]")},
            "latencies_s": latencies}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateways", required=True, help="comma-separated gateway URLs")
    p.add_argument("--verifier-metrics", help="comma-separated metrics URLs of the gateways' verifiers, in order")
    p.add_argument("--drafter-metrics", help="comma-separated metrics URLs of the gateways' drafters, in order")
    p.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--mode", default="ddtree", choices=("ddtree", "chain", "off"))
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled rounds")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    urls = [u.rstrip("/") for u in args.gateways.split(",")]
    def per_gateway(value: str | None) -> list[str | None]:
        return [u.rstrip("/") for u in value.split(",")] if value else [None] * len(urls)

    metrics = list(zip(per_gateway(args.verifier_metrics), per_gateway(args.drafter_metrics)))
    model = {served_model(url) for url in urls}.pop()  # every stack speculating before any is timed
    rng = random.Random(0)
    counts = [int(c) for c in args.clients.split(",")]
    for url in urls:  # warm-up, as many clients as the most of the run: their sessions' first rounds capture graphs
        asyncio.run(load(url, (None, None), model, max(counts),
                         argparse.Namespace(**{**vars(args), "requests_per_client": 1}), rng))
    results: dict[str, list[dict]] = {u: [] for u in urls}
    for i, clients in enumerate(counts):
        for url, metric in (list(zip(urls, metrics)) if i % 2 == 0 else list(zip(urls, metrics))[::-1]):
            r = asyncio.run(load(url, metric, model, clients, args, rng))
            results[url].append(r)
            batch = "" if r["mean_batch"] is None else f", mean batch {r['mean_batch']:.2f}"
            batch += "" if r["mean_draft_batch"] is None else f", mean draft batch {r['mean_draft_batch']:.2f}"
            phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in r["round_phase_ms"].items())
            print(f"{url} {clients} clients: {r['tokens_per_s']:.1f} tokens/s, latency median "
                  f"{r['latency_median_s'] * 1000:.0f} ms, max {r['latency_max_s'] * 1000:.0f} ms{batch}; round ms: "
                  f"{phases}", flush=True)
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"settings": settings, "gateways": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
