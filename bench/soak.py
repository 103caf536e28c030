"""A soak: concurrent streaming chat clients against a running gateway for a while, watching the processes' memory
and the services' live sessions and caches, to see whether anything grows that should not.

    python bench/soak.py --gateway http://127.0.0.1:8123 --verifier-metrics http://127.0.0.1:9473 \
        --drafter-metrics http://127.0.0.1:9474 --pids gateway=PID,verifier=PID,drafter=PID \
        --clients 4 --duration 300 --out soak.json

Each client sends streaming chat requests one after another (a fresh short prompt each, greedy) until the duration
is over; every --interval seconds the sampler reads each PID's resident memory (VmRSS in /proc/PID/status) and the
gauges: the gateway's requests running and waiting (and its AR fallbacks so far), the verifier's and drafter's live
sessions, cache bytes and round lane connections.
The JSON holds, per process, the RSS at the start, the end and the largest; the requests by outcome (ok, or the
error: an HTTP status, an error event inside the stream, a transport failure); the gauges before the clients
start and after they end (once the gateway has no request running, within --settle seconds); and every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ddtree.bench_gateway import served_model

WORDS = ("river", "stone", "light", "paper", "garden", "window", "silver", "music", "number", "morning", "yellow",
         "engine", "circle", "market", "winter", "bridge", "letter", "forest", "pocket", "summer")
# source -> the gauges read from its /metrics (gateway/metrics.py; runtime/service.py ServiceMetrics)
# (and the requests that fell back to AR so far, a counter: a soak of speculating requests should see none)
GAUGES = {
    "gateway": ("ddtree_requests_running", "ddtree_requests_waiting", "ddtree_fallbacks_total"),
    "verifier": ("ddtree_verify_active_sessions", "ddtree_verify_kv_cache_bytes", "ddtree_verify_lane_connections"),
    "drafter": ("ddtree_draft_active_sessions", "ddtree_draft_context_cache_bytes", "ddtree_draft_lane_connections"),
}


def rss_bytes(pid: int) -> int | None:
    """The process's resident set (VmRSS); None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


async def gauges(http: httpx.AsyncClient, sources: dict[str, str]) -> dict[str, float | None]:
    """Every source's gauges by name; None where a source does not answer."""
    values: dict[str, float | None] = {}
    for source, url in sources.items():
        names = GAUGES[source]
        try:
            text = (await http.get(f"{url}/metrics", timeout=10)).text
        except httpx.HTTPError:
            values.update(dict.fromkeys(names))
            continue
        found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        values.update({name: found.get(name) for name in names})
    return values


async def sample(http: httpx.AsyncClient, pids: dict[str, int], sources: dict[str, str], start: float
                 ) -> dict[str, Any]:
    return {"t": round(time.monotonic() - start, 2), "rss": {name: rss_bytes(pid) for name, pid in pids.items()},
            "gauges": await gauges(http, sources)}


async def client(http: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace, until: float,
                 outcomes: Counter[str], rng: random.Random) -> None:
    """Streaming requests one after another until `until`; each counted by outcome."""
    while time.monotonic() < until:
        text = " ".join(rng.choice(WORDS) for _ in range(8))
        body = {"model": model, "messages": [{"role": "user", "content": f"Write about {text}."}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    outcomes[str(reply.status_code)] += 1
                    continue
                outcome = "no [DONE]"  # unless the stream ends as it should
                async for line in reply.aiter_lines():
                    if line == "data: [DONE]":
                        outcome = "ok" if outcome == "no [DONE]" else outcome
                    elif line.startswith("data: ") and "error" in json.loads(line[len("data: "):]):
                        outcome = "error event"
                outcomes[outcome] += 1
        except httpx.HTTPError as exc:
            outcomes[f"transport {type(exc).__name__}"] += 1


async def soak(args: argparse.Namespace, pids: dict[str, int], sources: dict[str, str]) -> dict[str, Any]:
    model = served_model(args.gateway)
    outcomes: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(limits=limits) as http:
        start = time.monotonic()
        samples.append(await sample(http, pids, sources, start))
        until = start + args.duration
        clients = [asyncio.create_task(client(http, args.gateway, model, args, until, outcomes, random.Random(i)))
                   for i in range(args.clients)]
        while not all(task.done() for task in clients):
            await asyncio.wait(clients, timeout=args.interval)
            samples.append(await sample(http, pids, sources, start))
        await asyncio.gather(*clients)
        settle = time.monotonic() + args.settle
        last = samples[-1]
        while last["gauges"].get("ddtree_requests_running") and time.monotonic() < settle:
            await asyncio.sleep(0.5)
            last = await sample(http, pids, sources, start)
        samples.append(last)
    rss = {}
    for name in pids:
        seen = [s["rss"][name] for s in samples if s["rss"][name] is not None]
        rss[name] = {"start": samples[0]["rss"][name], "end": samples[-1]["rss"][name], "max": max(seen, default=None)}
    return {
        "config": {"gateway": args.gateway, "clients": args.clients, "duration_s": args.duration,
                   "max_tokens": args.max_tokens, "interval_s": args.interval, "pids": pids, "model": model},
        "wall_s": round(samples[-1]["t"], 1),
        "requests": {"ok": outcomes["ok"], "error": {k: v for k, v in sorted(outcomes.items()) if k != "ok"}},
        "rss_bytes": rss,
        "gauges": {"start": samples[0]["gauges"], "end": samples[-1]["gauges"]},
        "samples": samples,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", required=True, help="the gateway's URL (its /metrics is read too)")
    p.add_argument("--verifier-metrics", help="the verifier's metrics URL (ddtree serve --verify-metrics-port)")
    p.add_argument("--drafter-metrics", help="the drafter's metrics URL (ddtree serve --draft-metrics-port)")
    p.add_argument("--pids", default="", help="NAME=PID,... processes whose RSS is sampled (e.g. the children of "
                                              "ddtree serve: ps --ppid SERVE_PID)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--duration", type=float, default=300.0, help="seconds the clients send requests")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--settle", type=float, default=10.0, help="seconds the end waits for running requests to end")
    p.add_argument("--out", required=True, help="the JSON file")
    args = p.parse_args()
    pids = {name: int(pid) for name, pid in (item.split("=") for item in args.pids.split(",") if item)}
    sources = {"gateway": args.gateway, "verifier": args.verifier_metrics, "drafter": args.drafter_metrics}
    result = asyncio.run(soak(args, pids, {k: v for k, v in sources.items() if v}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("wall_s", "requests", "rss_bytes", "gauges")}, indent=1))


if __name__ == "__main__":
    main()
