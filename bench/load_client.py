"""Streamed chat requests as a client sees them, and the services' Prometheus metrics around a measurement: shared by
bench/concurrent_load.py (client counts) and bench/capacity.py (sessions held at once).

A stream's time to first token (TTFT) is the send to its first content chunk. Its inter-token latency (ITL) is read
per token: the gap before each later content chunk is split evenly over the tokens the chunk's text holds (counted
by the gateway's own tokenizer, POST /tokenize, at least 1), so a chunk of k tokens gives k samples of gap / k, the
rule of the gateway's own ddtree_inter_token_latency_seconds (a round's interval over the tokens it committed).
Under speculation a chunk carries a round's tokens: the gaps as they are (vLLM's bench calls those ITL) are kept
beside it as the chunk gaps.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

WORDS = ("river", "stone", "light", "paper", "garden", "window", "silver", "music", "number", "morning", "yellow",
         "engine", "circle", "market", "winter", "bridge", "letter", "forest", "pocket", "summer")
TOKENIZE_CALLS = 16  # /tokenize calls in flight at once while chunks are counted


def prompt(seed: str, words: int) -> str:
    """`words` words drawn by `seed`: the same seed, the same prompt, in every run."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Stream:
    """One streamed request. times: each content chunk's arrival, seconds after the request was sent."""

    sent: float = 0.0  # time.perf_counter() when it was sent
    chunks: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    completion_tokens: int = 0  # the usage chunk's count
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] if self.times else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]

    def itl_s(self, counts: dict[str, int]) -> list[float]:
        """Per-token ITL samples (the module's rule); counts: tokens of each chunk text (TokenCounter.counts)."""
        samples = []
        for gap, chunk in zip(self.gaps_s, self.chunks[1:]):
            tokens = max(1, counts[chunk])
            samples += [gap / tokens] * tokens
        return samples


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict) -> Stream:
    """POST body to url's /v1/chat/completions as a stream; a failure (an HTTP status, an error event, a broken or
    unfinished stream) is recorded in the Stream's error, never raised."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stream, done = Stream(sent=start), False
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                stream.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        stream.error = f"error event: {event['error'].get('message')}"
                    if event.get("usage"):
                        stream.completion_tokens = event["usage"]["completion_tokens"]
                    for choice in event.get("choices", ()):
                        if content := choice.get("delta", {}).get("content"):
                            stream.times.append(time.perf_counter() - start)
                            stream.chunks.append(content)
                if not done and stream.error is None:
                    stream.error = "the stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    stream.e2e_s = time.perf_counter() - start
    return stream


class TokenCounter:
    """Tokens of chunk texts by the gateway's tokenizer (POST /tokenize without special tokens), each distinct text
    asked once; counted after a measurement, outside its timed window."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.counts: dict[str, int] = {}

    async def count(self, http: httpx.AsyncClient, texts: Iterable[str]) -> None:
        limit = asyncio.Semaphore(TOKENIZE_CALLS)

        async def one(text: str) -> None:
            async with limit:
                reply = await http.post(f"{self.url}/tokenize", json={"model": self.model, "prompt": text,
                                                                      "add_special_tokens": False})
            reply.raise_for_status()
            self.counts[text] = reply.json()["count"]

        await asyncio.gather(*(one(t) for t in set(texts) - self.counts.keys()))


def percentiles(values: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99), linear between samples; (None, None) without any."""
    if not values:
        return None, None
    p50, p99 = np.percentile(values, [50, 99])
    return float(p50), float(p99)


def scrape(url: str | None) -> dict[str, float]:
    """Every sample of a /metrics page, keyed as sample_key writes it; {} without a URL."""
    if url is None:
        return {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {sample_key(s.name, **s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def sample_key(name: str, **labels: str) -> str:
    return name + "".join(f"[{k}={v}]" for k, v in sorted(labels.items()))


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters and histograms over a measurement (after - before)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_mean(delta: dict[str, float], name: str, **labels: str) -> float | None:
    """A histogram's mean over a measurement; None where it observed nothing."""
    count = delta.get(sample_key(f"{name}_count", **labels), 0.0)
    return delta[sample_key(f"{name}_sum", **labels)] / count if count else None


def histogram_counts(delta: dict[str, float], name: str) -> dict[str, int]:
    """A histogram's observations over a measurement by bucket, keyed by the bucket's upper bound (each value in
    (the previous bound, this one]); empty buckets left out."""
    prefix = sample_key(f"{name}_bucket", le="")[: -1]
    cumulative = sorted(((float(k[len(prefix):-1]), v) for k, v in delta.items() if k.startswith(prefix)))
    counts, below = {}, 0.0
    for bound, total in cumulative:
        if total > below:
            counts[f"{bound:g}"] = int(total - below)
        below = total
    return counts
