"""Concurrent streaming chat clients through running gateways, side by side: at each client count, speculation mode
and temperature, aggregate tokens/s, time to first token, inter-token latency and the services' batches.

    python bench/concurrent_load.py --gateways http://127.0.0.1:8011,http://127.0.0.1:8021 \
        --verifier-metrics http://127.0.0.1:9472,http://127.0.0.1:9482 --clients 1,4,16,64 \
        --modes off,chain,ddtree --temperatures 0,0.7 --requests 3 --max-tokens 64 --check-alone --out load.json

Each client sends --requests streamed requests one after another (the mode as the request's `speculation`), every
client starting at once, each request a prompt of its own (a level's prompts are new to the server, so no cached
prefix of an earlier level shortens them; the gateways side by side get the same ones). At each level the gateways
take turns (the order alternating), so each sees the same machine state; one warm-up round first (as many clients
as the most of the run, every mode and temperature), so no graph capture or compile is timed. --check-alone sends
every greedy request again, one at a time, after the levels, and reports per level the share of greedy streams
whose text equals the same request's alone (in --alone-mode off: the target's own AR answer).

Reported per gateway, mode, temperature and client count: completion tokens (the streams' usage) / wall time, every
request's TTFT and their p50 / p99, the per-token ITL p50 / p99 and the chunk gaps' (bench/load_client.py says how
ITL is read), end-to-end p50 / p99, failed requests and a few of their messages; from the gateway's metrics τ,
the mean requests in a step's Step call (ddtree_step_batch_size), the tree sizes drafted (ddtree_spec_tree_size:
mean and rounds by bucket), the mean time a round spent in each phase (ddtree_round_phase_seconds) and the TTFT's
two parts, the wait for a slot and the sessions' start and prefill (ddtree_request_{queue,prefill}_time_seconds);
with --verifier-metrics the sizes the verifier's load-adaptive fit cut a step's trees to (ddtree_step_tree_nodes:
mean and steps by bucket), the verifier's mean batch a forward (ddtree_verify_batch_size) and its forwards per
second, its mean prompt chunks a prompt forward (ddtree_verify_prefill_batch_size), the mean server-side time of
its session calls (EndSession, and StartSession where a client calls it apart from a prompt's first chunk: queueing
for the engine included), and the CUDA graphs it captured during the
level (ddtree_verify_cuda_graphs: steps that waited for a capture) and the batches of AR steps it launched behind a
step still unread (ddtree_verify_decodes_launched_ahead_total), with --drafter-metrics the drafter's
(ddtree_draft_batch_size). One JSON (--out) and its figure, a PNG of the same name (ddtree/plots.py load_figure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import time
from pathlib import Path

import httpx

from ddtree.bench_gateway import served_model
from ddtree.plots import load_figure, save_figure
from gateway.metrics import PHASES
# bench/'s own module (a script's folder is on its sys.path)
from load_client import (Stream, TokenCounter, difference, histogram_counts, histogram_mean, percentiles, prompt,
                         scrape, stream_chat)

ERROR_SAMPLES = 5  # distinct failure messages kept per level
SESSION_RPCS = ("StartSession", "EndSession")  # the verifier's calls around the steps


def seed(mode: str, temperature: str, clients: int, client: int, request: int) -> str:
    """The prompt of a level's request (load_client.prompt)."""
    return f"{mode}/{temperature}/{clients}/{client}/{request}"


def sampling(temperature: str) -> dict:
    """A --temperatures entry as the request's fields: `0.7` samples unseeded, `0.7s` with a seed of its own."""
    value, seeded = temperature.removesuffix("s"), temperature.endswith("s")
    return {"temperature": float(value), **({"seed": 1234} if seeded else {})}


def speculation(mode: str) -> dict:
    """A --modes entry as the request's `speculation`: `ddtree:64` asks for tree budget 64."""
    name, _, budget = mode.partition(":")
    return {"mode": name, **({"budget": int(budget)} if budget else {})}


def body(model: str, key: str, mode: str, temperature: str, args: argparse.Namespace) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt(key, args.prompt_words)}],
            "max_tokens": args.max_tokens, **sampling(temperature), "speculation": speculation(mode),
            **({"ignore_eos": True} if args.ignore_eos else {})}


async def level(url: str, metrics: tuple[str | None, str | None], model: str, mode: str, temperature: str,
                clients: int, args: argparse.Namespace, counter: TokenCounter) -> dict:
    """One measurement: `clients` clients at once, each sending its requests back to back."""

    async def client(http: httpx.AsyncClient, c: int) -> list[Stream]:
        return [await stream_chat(http, url, body(model, seed(mode, temperature, clients, c, r), mode, temperature,
                                                  args)) for r in range(args.requests)]

    before = [scrape(u) for u in (url, *metrics)]
    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=clients + 1)) as http:
        start = time.perf_counter()
        streams = await asyncio.gather(*(client(http, c) for c in range(clients)))
        wall = time.perf_counter() - start
        gateway, verifier, drafter = (difference(scrape(u), b) for u, b in zip((url, *metrics), before))
        done = [s for per_client in streams for s in per_client if s.error is None]
        await counter.count(http, (chunk for s in done for chunk in s.chunks))
    failed = [s.error for per_client in streams for s in per_client if s.error is not None]
    tokens = sum(s.completion_tokens for s in done)
    ttft = [s.ttft_s for s in done if s.ttft_s is not None]
    drafts = gateway.get("ddtree_spec_drafts_total", 0.0)
    forwards = verifier.get("ddtree_verify_batch_size_count", 0.0)
    r = {"gateway": url, "mode": mode, "temperature": sampling(temperature)["temperature"],
         "seeded": temperature.endswith("s"), "clients": clients,
         "requests": clients * args.requests, "errors": len(failed),
         "error_samples": list(dict.fromkeys(failed))[:ERROR_SAMPLES], "tokens": tokens, "wall_s": wall,
         "tokens_per_s": tokens / wall, "ttft_s": ttft}
    for name, values in (("ttft", ttft), ("itl", [x for s in done for x in s.itl_s(counter.counts)]),
                         ("chunk_gap", [x for s in done for x in s.gaps_s]), ("e2e", [s.e2e_s for s in done])):
        r[f"{name}_p50_s"], r[f"{name}_p99_s"] = percentiles(values)
    r |= {"tau": 1 + gateway.get("ddtree_spec_accepted_tokens_total", 0.0) / drafts if drafts else None,
          "mean_step_batch": histogram_mean(gateway, "ddtree_step_batch_size", rpc="Step"),
          "mean_tree_size": histogram_mean(gateway, "ddtree_spec_tree_size"),
          "tree_sizes": histogram_counts(gateway, "ddtree_spec_tree_size"),
          "mean_fitted_tree_size": histogram_mean(verifier, "ddtree_step_tree_nodes"),
          "fitted_tree_sizes": histogram_counts(verifier, "ddtree_step_tree_nodes"),
          "mean_verify_batch": histogram_mean(verifier, "ddtree_verify_batch_size"),
          "mean_prefill_batch": histogram_mean(verifier, "ddtree_verify_prefill_batch_size"),
          "graphs_captured": verifier.get("ddtree_verify_cuda_graphs"),
          "launched_ahead": verifier.get("ddtree_verify_decodes_launched_ahead_total"),
          "forwards_per_s": forwards / wall if metrics[0] else None,
          "mean_draft_batch": histogram_mean(drafter, "ddtree_draft_batch_size"),
          "round_phase_ms": {p: 1000 * ms for p in PHASES
                             if (ms := histogram_mean(gateway, "ddtree_round_phase_seconds", phase=p)) is not None},
          "ttft_parts_ms": {part: 1000 * ms for part in ("queue", "prefill")
                            if (ms := histogram_mean(gateway, f"ddtree_request_{part}_time_seconds")) is not None},
          "verifier_rpc_ms": {rpc: 1000 * ms for rpc in SESSION_RPCS if (ms := histogram_mean(
              verifier, "ddtree_verify_request_duration_seconds", rpc=rpc)) is not None}}
    if r["temperature"] == 0:  # greedy: [client][request], None where the request failed
        r["texts"] = [[None if s.error else s.text for s in per_client] for per_client in streams]
    return r


async def equal_alone(model: str, run: dict, args: argparse.Namespace) -> float:
    """The share of a greedy level's streams whose text equals its request's sent again alone (one at a time), in
    the level's mode or in --alone-mode."""
    equal = 0
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        for c, texts in enumerate(run["texts"]):
            for r, text in enumerate(texts):
                stream = await stream_chat(http, run["gateway"], body(
                    model, seed(run["mode"], "0", run["clients"], c, r), args.alone_mode or run["mode"], "0", args))
                equal += text is not None and stream.error is None and stream.text == text
    return equal / run["requests"]


async def warm_up(url: str, model: str, modes: list[str], temperatures: list[str], clients: int,
                  args: argparse.Namespace) -> list[str]:
    """One request per client, the modes and temperatures in turn; the failures' messages."""
    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=clients + 1)) as http:
        streams = await asyncio.gather(*(
            stream_chat(http, url, body(model, f"warm-up/{c}", modes[c % len(modes)],
                                        temperatures[c % len(temperatures)], args)) for c in range(clients)))
    return [s.error for s in streams if s.error is not None]


def report_line(r: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1000 * value:.1f}"

    extra = "".join(f", {label} {r[key]:.2f}" for key, label in (
        ("tau", "tau"), ("mean_step_batch", "step batch"), ("mean_verify_batch", "verify batch"),
        ("mean_prefill_batch", "prefill batch"), ("graphs_captured", "graphs captured"),
        ("launched_ahead", "AR steps launched ahead"),
        ("mean_draft_batch", "draft batch"), ("mean_tree_size", "tree"), ("mean_fitted_tree_size", "verified tree"))
        if r[key] is not None)
    parts = "".join(f", TTFT {part} {value:.1f} ms" for part, value in r["ttft_parts_ms"].items())
    parts += "".join(f", verifier {rpc} {value:.1f} ms" for rpc, value in r["verifier_rpc_ms"].items())
    seeded = " seeded" if r["seeded"] else ""
    return (f"{r['gateway']} {r['mode']} T={r['temperature']:g}{seeded} {r['clients']} clients: {r['tokens_per_s']:.1f} "
            f"tokens/s, TTFT p50/p99 {ms(r['ttft_p50_s'])}/{ms(r['ttft_p99_s'])} ms, ITL p50/p99 "
            f"{ms(r['itl_p50_s'])}/{ms(r['itl_p99_s'])} ms, errors {r['errors']}{extra}{parts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateways", required=True, help="comma-separated gateway URLs")
    p.add_argument("--verifier-metrics", help="comma-separated metrics URLs of the gateways' verifiers, in order")
    p.add_argument("--drafter-metrics", help="comma-separated metrics URLs of the gateways' drafters, in order")
    p.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts")
    p.add_argument("--modes", "--mode", default="ddtree",
                   help="comma-separated speculation modes, each a request's speculation.mode: off (AR), chain, "
                        "ddtree; ddtree:N also sets the request's tree budget to N")
    p.add_argument("--temperatures", "--temperature", default="0",
                   help="comma-separated temperatures; 0: greedy, above: sampled rounds; `0.7s`: sampled with a seed")
    p.add_argument("--requests", "--requests-per-client", type=int, default=3, help="requests each client sends")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens (vLLM's ignore_eos)")
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--check-alone", action="store_true",
                   help="send every greedy request again alone and report the share of equal texts")
    p.add_argument("--alone-mode", choices=("off", "chain", "ddtree"),
                   help="--check-alone sends the requests again in this mode (off: the target's own AR answer, so a "
                        "speculative level's share counts its streams equal to plain decoding; default: the level's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--out", type=Path, required=True, help="the JSON; its figure goes beside it as .png")
    args = p.parse_args()
    urls = [u.rstrip("/") for u in args.gateways.split(",")]

    def per_gateway(value: str | None) -> list[str | None]:
        return [u.rstrip("/") for u in value.split(",")] if value else [None] * len(urls)

    metrics = list(zip(per_gateway(args.verifier_metrics), per_gateway(args.drafter_metrics)))
    counts = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    if unknown := {m for m in modes if not re.fullmatch(r"off|chain|ddtree(:[1-9][0-9]*)?", m)}:
        p.error(f"--modes: unknown {sorted(unknown)}; choose from off, chain, ddtree, ddtree:BUDGET")
    temperatures = args.temperatures.split(",")
    if unknown := [t for t in temperatures if not re.fullmatch(r"[0-9]+(\.[0-9]*)?s?", t)]:
        p.error(f"--temperatures: {unknown} are no temperatures (a number, `s` after it: seeded)")
    if args.check_alone and not any(float(t.removesuffix("s")) == 0 for t in temperatures):
        p.error("--check-alone compares greedy answers: --temperatures needs 0")
    if args.alone_mode and not args.check_alone:
        p.error("--alone-mode is the mode of --check-alone's requests: add --check-alone")
    model = {served_model(url) for url in urls}.pop()  # every stack speculating before any is timed
    counters = {url: TokenCounter(url, model) for url in urls}
    for url in urls:
        if failed := asyncio.run(warm_up(url, model, modes, temperatures, max(counts), args)):
            print(f"{url} warm-up: {len(failed)} requests failed, e.g. {failed[0]}", flush=True)
    runs = []
    for mode in modes:
        for temperature in temperatures:
            for i, clients in enumerate(counts):
                for url, metric in list(zip(urls, metrics))[:: 1 if i % 2 == 0 else -1]:
                    runs.append(asyncio.run(level(url, metric, model, mode, temperature, clients, args, counters[url])))
                    print(report_line(runs[-1]), flush=True)
    if args.check_alone:
        for r in runs:
            if r["temperature"] == 0:
                r["equal_alone"] = asyncio.run(equal_alone(model, r, args))
                print(f"{r['gateway']} {r['mode']} {r['clients']} clients: greedy answers equal to alone"
                      f"{' in mode ' + args.alone_mode if args.alone_mode else ''} "
                      f"{r['equal_alone']:.2f}", flush=True)
    result = {
        "hardware": {"gateways": urls, "python": platform.python_version(),
                     "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "model_pair": {"served_model": model},
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "clients": counts, "modes": modes,
                     "temperatures": temperatures},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    save_figure(load_figure, result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
