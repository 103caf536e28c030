"""Sessions held at once: N streamed requests of L tokens each (prompt and answer together: a prompt of about L / 2
tokens, the answer run to the rest with ignore_eos), all sent at once, all to be held together and to complete.

    ddtree serve --max-sessions 128 --max-running 128 --verify-metrics-port 9472 --draft-metrics-port 9473 ...
    python bench/capacity.py --gateway http://127.0.0.1:8000 --verifier-metrics http://127.0.0.1:9472 \
        --drafter-metrics http://127.0.0.1:9473 --sessions 128 --context 2048 --modes off,ddtree --out capacity.json

With --open-ended the requests ask for no token limit, as chat clients often send them (the server then allows the
rest of the context), and answer until the model ends them (or a --stop string does): what memory a server holds for
sessions that may run long but mostly stop early. The prompts are still about L / 2 tokens, and L need not be the model's context.

Reported per mode: the requests that completed (every one of its L tokens), the failures and a few of their
messages, the most streams held at once (by the streams' own clocks: the most that were between their first chunk
and their end at one instant; N where every session was held together), tokens/s, and the peaks of the services'
gauges, sampled every SAMPLE_S while the requests run: the gateway's requests running and waiting, each model
service's live sessions and cache bytes (the verifier's KV cache, ddtree_verify_kv_cache_bytes; the drafter's
context K/V) and, on a GPU, its memory allocated. One JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from ddtree.bench_gateway import served_model
# bench/'s own module (a script's folder is on its sys.path)
from load_client import Stream, prompt, scrape, stream_chat

SAMPLE_S = 0.1
GAUGES = ("ddtree_requests_running", "ddtree_requests_waiting",  # the gateway's
          "ddtree_verify_active_sessions", "ddtree_verify_kv_cache_bytes", "ddtree_verify_gpu_memory_allocated_bytes",
          "ddtree_draft_active_sessions", "ddtree_draft_context_cache_bytes", "ddtree_draft_gpu_memory_allocated_bytes")
ERROR_SAMPLES = 5


async def prompts(http: httpx.AsyncClient, url: str, model: str, mode: str, sessions: int,
                  context: int) -> list[tuple[str, int]]:
    """Each session's prompt of about context / 2 tokens as the chat template renders it, with its exact count
    (the gateway's /tokenize): the template's own tokens and the words' rate from two probes. A mode's prompts are
    its own, so none finds its prefix cached by another's."""

    async def tokens(text: str) -> int:
        reply = await http.post(f"{url}/tokenize", json={"model": model,
                                                         "messages": [{"role": "user", "content": text}]})
        reply.raise_for_status()
        return reply.json()["count"]

    short, long = await tokens(prompt("probe", 10)), await tokens(prompt("probe", 110))
    rate = (long - short) / 100  # tokens a word
    words = max(1, round((context / 2 - (short - 10 * rate)) / rate))
    texts = [prompt(f"capacity/{mode}/{i}", words) for i in range(sessions)]
    return list(zip(texts, await asyncio.gather(*(tokens(t) for t in texts))))


def held_at_once(streams: list[Stream]) -> int:
    """The most streams between their first chunk and their end at one instant."""
    edges = sorted(edge for s in streams if s.times
                   for edge in ((s.sent + s.times[0], 1), (s.sent + s.e2e_s, -1)))  # at a tie an end goes first
    most = held = 0
    for _, step in edges:
        held += step
        most = max(most, held)
    return most


def limit(args: argparse.Namespace, prompt_tokens: int) -> dict:
    """A request's token limit: its answer runs to L (ignore_eos); open-ended, none (the stop strings, if any)."""
    if args.open_ended:
        return {"stop": args.stop} if args.stop else {}
    return {"max_tokens": args.context - prompt_tokens, "ignore_eos": True}


async def capacity(url: str, metrics: list[str | None], model: str, mode: str, args: argparse.Namespace) -> dict:
    peaks: dict[str, float] = {}
    running = True

    async def sample() -> None:
        while running:
            for page in await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in (url, *metrics))):
                for name in GAUGES:
                    if name in page:
                        peaks[name] = max(peaks.get(name, 0.0), page[name])
            await asyncio.sleep(SAMPLE_S)

    limits = httpx.Limits(max_connections=args.sessions + 1)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        sessions = await prompts(http, url, model, mode, args.sessions, args.context)
        if short := [count for _, count in sessions if count >= args.context]:
            raise SystemExit(f"--context {args.context} leaves no answer after a prompt of {short[0]} tokens")
        sampler = asyncio.create_task(sample())
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_chat(http, url, {
            "model": model, "messages": [{"role": "user", "content": text}], **limit(args, count),
            "temperature": args.temperature, "speculation": {"mode": mode}})
            for text, count in sessions))
        wall = time.perf_counter() - start
        running = False
        await sampler
    failed = [s.error for s in streams if s.error is not None]
    complete = [s for (_, count), s in zip(sessions, streams)
                if s.error is None and (args.open_ended or s.completion_tokens == args.context - count)]
    return {"gateway": url, "mode": mode, "temperature": args.temperature, "sessions": args.sessions,
            "context": args.context, "prompt_tokens": [count for _, count in sessions], "completed": len(complete),
            "errors": len(failed), "error_samples": list(dict.fromkeys(failed))[:ERROR_SAMPLES],
            "held_at_once": held_at_once(streams), "wall_s": wall, "open_ended": args.open_ended,
            "completion_tokens": [s.completion_tokens for s in streams],
            "tokens_per_s": sum(s.completion_tokens for s in streams if s.error is None) / wall, "peaks": peaks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", required=True, help="the gateway's URL")
    p.add_argument("--verifier-metrics", help="the metrics URL of the gateway's verifier")
    p.add_argument("--drafter-metrics", help="the metrics URL of the gateway's drafter")
    p.add_argument("--sessions", type=int, required=True, help="requests sent at once (N)")
    p.add_argument("--context", type=int, required=True, help="tokens of each, prompt and answer together (L)")
    p.add_argument("--modes", default="ddtree", help="comma-separated speculation modes, one measurement each: off "
                   "(AR), chain, ddtree")
    p.add_argument("--open-ended", action="store_true", help="requests ask for no token limit and answer until the "
                   "model ends them (L sizes the prompts only)")
    p.add_argument("--stop", action="append", help="with --open-ended: a stop string (repeatable), so that answers "
                   "end early, as most chats do")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - {"off", "chain", "ddtree"}:
        p.error(f"--modes: unknown {sorted(unknown)}; choose from off, chain, ddtree")
    if args.sessions < 1 or args.context < 2:
        p.error("--sessions must be >= 1 and --context >= 2")
    url = args.gateway.rstrip("/")
    metrics = [u.rstrip("/") for u in (args.verifier_metrics, args.drafter_metrics) if u]
    model = served_model(url)
    runs = []
    for mode in modes:
        runs.append(r := asyncio.run(capacity(url, metrics, model, mode, args)))
        peaks = ", ".join(f"{name} {value:.0f}" for name, value in r["peaks"].items())
        print(f"{url} {mode}: {r['completed']} of {r['sessions']} x {r['context']} tokens completed, {r['errors']} "
              f"failed, {r['held_at_once']} held at once, {r['tokens_per_s']:.1f} tokens/s; peaks: {peaks}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model_pair": {"served_model": model},
                                    "settings": {**{k: v for k, v in vars(args).items() if k != "out"},
                                                 "modes": modes},
                                    "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
