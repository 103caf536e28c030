"""`ddtree bench --gateway URL`: the same side-by-side comparison through running services.

Each mode is one pass over the prompts with the per-request `speculation` override. τ and the per-phase round
time come from the gateway's own Prometheus counters, read before and after each pass (passes run one at a time,
so the deltas belong to that mode alone): draft and verify are the services' device work, `server` their host
work around it, `transport` both ways (round lane or gRPC) and the gateway's orchestration (gateway/metrics.py).
Plain stdlib HTTP: nothing to install beyond the project.
"""

from __future__ import annotations

import json
import os
import platform
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ddtree.bench_report import mode_ratios, report, request_stats
from ddtree.plots import run_label
from gateway.metrics import PHASES
from tqdm import tqdm


COUNTERS = ("ddtree_spec_drafts_total", "ddtree_spec_draft_tokens_total", "ddtree_spec_accepted_tokens_total",
            "ddtree_generation_tokens_total", "ddtree_time_to_first_token_seconds_sum", "ddtree_time_to_first_token_seconds_count")


def _request(url: str, body: dict | None = None) -> dict | str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        raw = reply.read().decode()
    return json.loads(raw) if reply.headers.get_content_type() == "application/json" else raw


def served_model(url: str, wait_s: float = 900.0) -> str:
    """The model name a gateway serves (its /v1/models), once its /health says "ok": the verifier serving and the
    drafter too where one is configured. A gateway serves autoregressively while its drafter still warms up (long
    after the verifier is ready at large shapes), and a bench started then would time that as speculation.
    Raises TimeoutError after wait_s seconds of anything else."""
    deadline, status, said = time.monotonic() + wait_s, None, False
    while True:
        try:
            status = _request(f"{url}/health")
        except (OSError, ValueError) as exc:  # not listening yet, or 503 while loading
            status = str(exc)
        if isinstance(status, dict) and status.get("status") == "ok":
            return _request(f"{url}/v1/models")["data"][0]["id"]
        if not said:  # once: a wait of minutes says what it waits for
            print(f"[bench] waiting for {url} to speculate ({status}), up to {wait_s:.0f} s", flush=True)
            said = True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready for speculation after {wait_s:.0f} s: {status}")
        time.sleep(1.0)


def read_counters(url: str) -> dict[str, float]:
    """The speculation counters, and per phase its seconds (phase[...]) and the rounds that spent them
    (rounds[...]), flattened to name -> value."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(_request(f"{url}/metrics")):
        for s in family.samples:
            if s.name in COUNTERS:
                values[s.name] = s.value
            elif s.name == "ddtree_round_phase_seconds_sum":
                values[f"phase[{s.labels['phase']}]"] = s.value
            elif s.name == "ddtree_round_phase_seconds_count":
                values[f"rounds[{s.labels['phase']}]"] = s.value
    return values


def load_chat_prompts(path: str, limit: int) -> list[list[dict]]:
    prompts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            prompts.append([m for m in record["messages"] if m["role"] != "assistant"])
        if limit and len(prompts) >= limit:
            break
    return prompts


def run_gateway_bench(url: str, prompts_file: str, num_prompts: int, budgets: list[int], max_new: int, out: Path) -> dict:
    url = url.rstrip("/")
    model = served_model(url)
    prompts = load_chat_prompts(prompts_file, num_prompts)
    specs = [("ar", {"mode": "off"}), ("chain", {"mode": "chain"})] + [
        ("ddtree", {"mode": "ddtree", "budget": b}) for b in budgets
    ]

    def one_pass(speculation: dict, label: str) -> tuple[list[str], list[float]]:
        texts, seconds = [], []
        for messages in tqdm(prompts, desc=label, leave=False):
            body = {"model": model, "messages": messages, "max_tokens": max_new, "temperature": 0,
                    "speculation": speculation}
            start = time.perf_counter()
            reply = _request(f"{url}/v1/chat/completions", body)
            seconds.append(time.perf_counter() - start)
            texts.append(reply["choices"][0]["message"]["content"])
        return texts, seconds

    for mode, speculation in specs:  # every mode once first: no graph capture or compile inside a timed pass
        one_pass(speculation, f"warm-up {run_label({**speculation, 'mode': mode})}")
    runs = []
    for mode, speculation in specs:
        before = read_counters(url)
        texts, seconds = one_pass(speculation, run_label({**speculation, "mode": mode}))
        elapsed = sum(seconds)
        after = read_counters(url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        drafts = delta.get("ddtree_spec_drafts_total", 0.0)
        tokens = delta.get("ddtree_generation_tokens_total", 0.0)
        rounds = drafts or tokens  # an AR pass has one round per token
        phases_ms = {p: round(1000 * delta.get(f"phase[{p}]", 0.0) / max(rounds, 1), 3) for p in PHASES}
        runs.append({
            "mode": mode,
            # the chain's nodes a round (the drafter's block size - 1, as in-process) from the gateway's counters
            "budget": speculation.get("budget", round(delta.get("ddtree_spec_draft_tokens_total", 0.0) / drafts)
                                      if drafts else 0),
            "tokens": int(tokens),
            "seconds": round(elapsed, 4),
            "tokens_per_s": round(tokens / elapsed, 2),
            "tau": round(1 + delta.get("ddtree_spec_accepted_tokens_total", 0.0) / drafts, 3) if drafts else 1.0,
            "round_ms": round(sum(phases_ms.values()), 3),
            # arrival to first token at the gateway: tokenising, the prefill, and the transport both ways
            "ttft_ms": round(1000 * delta.get("ddtree_time_to_first_token_seconds_sum", 0.0)
                             / max(1.0, delta.get("ddtree_time_to_first_token_seconds_count", 0.0)), 3),
            "phases_ms": phases_ms,
            "request_ms": request_stats(seconds),
            # everything but the drafter's and the verifier's forwards, as in-process: the tree build, the walk, the
            # services' host work and the transport
            "overhead_share": round(1 - (phases_ms["draft"] + phases_ms["verify"]) / sum(phases_ms.values()), 3)
            if sum(phases_ms.values()) else None,
            "texts": texts,
        })
    reference = runs[0]["texts"]
    for r in runs:
        r["matches_ar"] = sum(a == b for a, b in zip(r.pop("texts"), reference)) / len(reference)
    result = {
        "hardware": {
            "gateway": url, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
        "model_pair": {"served_model": model},
        "settings": {"prompts": prompts_file, "num_prompts": len(prompts), "max_new_tokens": max_new, "temperature": 0.0},
        "runs": runs,
        "ratios": mode_ratios(runs),
    }
    report(result, out)
    return result
