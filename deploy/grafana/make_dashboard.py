"""Writes deploy/grafana/dashboards/ddtree.json, the DDTree serving dashboard, from the panel list below.

    python deploy/grafana/make_dashboard.py          # rewrite the JSON (commit both)
    python deploy/grafana/make_dashboard.py --check  # exit 1 when the JSON is not what this script writes

Every query uses only metrics that the gateway (gateway/metrics.py) and the two model services (runtime/service.py,
ServiceMetrics with prefixes ddtree_draft / ddtree_verify, and their servers' own: the verifier's tree fit exports
ddtree_step_tree_nodes, its step ddtree_verify_feature_rows_sent, the drafter's ddtree_draft_feature_rows_received)
export; tests/services/test_deploy.py checks that against live /metrics pages. Queries aggregate over instances (sum, sum by le), so several gateways or replicas just
add up, and the datasource is a dashboard variable, so the JSON can be imported into any Grafana with a Prometheus
datasource.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "ddtree.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "[$__rate_interval]"
TOKS = "suffix: tok/s"
PER_ROUND = "suffix: tok/round"


def rate(metric: str, by: str = "", selector: str = "", window: str = RI) -> str:
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}(rate({metric}{selector}{window}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{RI})))"


def mean(histogram: str, by: str = "") -> str:
    return f"{rate(histogram + '_sum', by)} / {rate(histogram + '_count', by)}"


TAU = f"1 + {rate('ddtree_spec_accepted_tokens_total')} / {rate('ddtree_spec_drafts_total')}"


def target(expr: str, legend: str = "", instant: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "range": not instant}
    if instant:
        t["instant"] = True
    return t


def timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str, *, stack: bool = False,
               bars: bool = False, decimals: int | None = None, overrides: list | None = None,
               legend_calcs: tuple[str, ...] = ("mean", "max", "lastNotNull"), max_: float | None = None) -> dict:
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "custom": {
            "drawStyle": "bars" if bars else "line",
            "lineWidth": 1,
            "fillOpacity": 60 if bars else (25 if stack else 8),
            "gradientMode": "none",
            "showPoints": "never",
            "spanNulls": False,
            "axisSoftMin": 0,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
        "color": {"mode": "palette-classic"},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"showLegend": True, "displayMode": "table", "placement": "bottom",
                       "calcs": list(legend_calcs)},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def stat(title: str, description: str, targets: list[dict[str, Any]], unit: str, *, decimals: int | None = None,
         thresholds: list[tuple[float | None, str]] | None = None, mappings: list | None = None,
         graph: bool = True) -> dict:
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": c, "value": v}
                                                     for v, c in (thresholds or [(None, "blue")])]},
        "mappings": mappings or [],
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area" if graph else "none",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
        "targets": targets,
    }


def bargauge(title: str, description: str, targets: list[dict[str, Any]], unit: str) -> dict:
    return {
        "type": "bargauge",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "max": 1, "color": {"mode": "continuous-GrYlRd"},
                                     "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]}},
                        "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
            "valueMode": "color",
            "namePlacement": "left",
        },
        "targets": targets,
    }


# gateway/metrics.py PHASES, each in one colour on both phase panels
PHASE_COLORS = (("draft", "purple"), ("tree", "light-purple"), ("verify", "blue"), ("walk", "light-blue"),
                ("server", "orange"), ("transport", "yellow"))


def color(series: str, name: str) -> dict:
    return {"matcher": {"id": "byName", "options": series},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": name}}]}


def percentiles(histogram: str, what: str) -> list[dict[str, Any]]:
    return [target(quantile(0.5, histogram), "p50"), target(quantile(0.9, histogram), "p90"),
            target(quantile(0.99, histogram), "p99"), target(mean(histogram), f"mean {what}")]


UP_MAPPING = [{"type": "value", "options": {"0": {"text": "DOWN", "color": "red", "index": 0},
                                            "1": {"text": "UP", "color": "green", "index": 1}}}]
FINISH_COLORS = [color("stop", "green"), color("length", "blue"), color("abort", "orange"), color("error", "red")]


def rows() -> list[tuple[str, list[tuple[dict, int, int]]]]:
    """(row title, [(panel, width, height)]) in display order; panels flow left to right, 24 columns wide."""
    errors = rate("ddtree_requests_total", selector='{finish_reason="error"}')
    aborts = rate("ddtree_requests_total", selector='{finish_reason="abort"}')
    finished = f"clamp_min({rate('ddtree_requests_total')}, 1e-9)"
    overview = [
        (stat("Requests / s", "Finished requests per second (all finish reasons).",
              [target(rate("ddtree_requests_total"))], "reqps", decimals=2), 3, 4),
        (stat("Error ratio", "Share of finished requests that ended with finish_reason=\"error\".",
              [target(f"{errors} / {finished}")], "percentunit", decimals=2,
              thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]), 3, 4),
        (stat("Generated tokens / s", "Tokens streamed to clients per second, all requests together.",
              [target(rate("ddtree_generation_tokens_total"))], TOKS, decimals=1), 3, 4),
        (stat("Acceptance length τ", "Tokens committed per drafted round over the dashboard's time range: "
              "1 + accepted / drafts (as vLLM reports it). 1.0 means the drafter never helps.",
              [target("1 + sum(increase(ddtree_spec_accepted_tokens_total[$__range])) / "
                      "sum(increase(ddtree_spec_drafts_total[$__range]))", instant=True)],
              PER_ROUND, decimals=2, thresholds=[(None, "red"), (1.5, "orange"), (2.5, "green")], graph=False), 3, 4),
        (stat("Running requests", "Requests decoding now (gateway).", [target("sum(ddtree_requests_running)")],
              "short", decimals=0), 3, 4),
        (stat("Waiting requests", "Requests queued for a decoding slot (gateway --max-running).",
              [target("sum(ddtree_requests_waiting)")], "short", decimals=0,
              thresholds=[(None, "green"), (1, "orange")]), 3, 4),
        (stat("Backends", "The gateway's view of its backends (grpc.health.v1 SERVING). Drafter DOWN: requests are "
              "decoded autoregressively (same output, slower). Verifier DOWN: requests fail with 503.",
              [target("min by (service) (ddtree_backend_up)", "{{service}}")], "none",
              mappings=UP_MAPPING, thresholds=[(None, "red"), (1, "green")], graph=False), 3, 4),
        (stat("AR fallbacks", "Requests that fell back to autoregressive decoding because a drafter call failed, "
              "over the dashboard's time range.",
              [target("sum(increase(ddtree_fallbacks_total[$__range]))", instant=True)], "short", decimals=0,
              thresholds=[(None, "green"), (1, "orange")], graph=False), 3, 4),
    ]
    requests = [
        (timeseries("Finished requests by reason", "Requests per second by finish reason: stop (EOS / stop string), "
                    "length (max_tokens or context), abort (client went away), error.",
                    [target(rate("ddtree_requests_total", "finish_reason"), "{{finish_reason}}")],
                    "reqps", stack=True, overrides=FINISH_COLORS), 8, 8),
        (timeseries("Errors and aborts", "Share of finished requests that ended in error or were aborted by the "
                    "client. gRPC-level failures of the backends are in the Backends row.",
                    [target(f"{errors} / {finished}", "error"), target(f"{aborts} / {finished}", "abort")],
                    "percentunit", overrides=[color("error", "red"), color("abort", "orange")]), 8, 8),
        (timeseries("Tokens / s", "Generated tokens streamed to clients and prompt tokens prefilled, per second.",
                    [target(rate("ddtree_generation_tokens_total"), "generated"),
                     target(rate("ddtree_prompt_tokens_total"), "prompt")], TOKS), 8, 8),
    ]
    latency = [
        (timeseries("Time to first token", "Request arrival to first generated token (queueing and prefill "
                    "included), and its two parts' p90: the wait for a decoding slot (and KV memory), then the "
                    "sessions' start and the prompt's prefill. Percentiles from the gateway's histograms.",
                    [*percentiles("ddtree_time_to_first_token_seconds", "TTFT"),
                     target(quantile(0.9, "ddtree_request_queue_time_seconds"), "queue p90"),
                     target(quantile(0.9, "ddtree_request_prefill_time_seconds"), "prefill p90")], "s"), 8, 8),
        (timeseries("Inter-token latency", "Per generated token after the first: round interval divided by the "
                    "tokens the round committed. Speculation lowers it by committing several tokens per round.",
                    percentiles("ddtree_inter_token_latency_seconds", "ITL"), "s"), 8, 8),
        (timeseries("End-to-end request latency", "Request arrival to last token.",
                    percentiles("ddtree_e2e_request_latency_seconds", "E2E"), "s"), 8, 8),
    ]
    per_depth = "ddtree_spec_accepted_tokens_per_depth_total"
    speculation = [
        (timeseries("Acceptance length τ", "Tokens committed per drafted round: 1 + rate(accepted) / rate(drafts) "
                    "(accepted draft tokens plus the bonus token), and percentiles of the per-round histogram.",
                    [target(TAU, "τ = 1 + accepted / drafts"),
                     target(quantile(0.5, "ddtree_spec_acceptance_length"), "p50"),
                     target(quantile(0.9, "ddtree_spec_acceptance_length"), "p90")],
                    PER_ROUND, decimals=2), 8, 8),
        (timeseries("Acceptance by tree depth", "Share of drafted rounds whose accepted path reaches depth d "
                    "(depth 1 = the first draft token). Falls with depth; the area under it is τ - 1.",
                    [target(f"{rate(per_depth, 'depth')} / scalar({rate('ddtree_spec_drafts_total')})",
                            "depth {{depth}}")],
                    "percentunit", max_=1), 8, 8),
        (bargauge("Acceptance by depth (time range)", "The same share over the dashboard's time range.",
                  [target(f"sum by (depth) (increase({per_depth}[$__range])) / "
                          f"scalar(sum(increase(ddtree_spec_drafts_total[$__range])))", "depth {{depth}}",
                          instant=True)], "percentunit"), 8, 8),
        (timeseries("Tree size", "Draft tree nodes per drafted round (root excluded): the budget actually used; "
                    "and the nodes the verifier cut a step's trees to before their verify (load-adaptive trees, "
                    "--fit-trees): below the drafted size when the step's load makes rows cost, 0 where the "
                    "step went AR.",
                    [target(f"{rate('ddtree_spec_draft_tokens_total')} / {rate('ddtree_spec_drafts_total')}",
                            "mean"),
                     target(quantile(0.5, "ddtree_spec_tree_size"), "p50"),
                     target(quantile(0.9, "ddtree_spec_tree_size"), "p90"),
                     target(mean("ddtree_step_tree_nodes"), "verified mean (cut)")], "none", decimals=1), 8, 8),
        (timeseries("Draft efficiency", "Accepted draft tokens per proposed tree node: how much of the tree the "
                    "target keeps. Larger trees raise τ but lower this.",
                    [target(f"{rate('ddtree_spec_accepted_tokens_total')} / "
                            f"{rate('ddtree_spec_draft_tokens_total')}", "accepted / proposed")],
                    "percentunit"), 8, 8),
        (timeseries("Rounds and AR fallbacks", "Drafted rounds per second, requests that fell back to "
                    "autoregressive decoding because the drafter failed, steps the verifier decoded "
                    "autoregressively because at their load no tree paid for its draft (--fit-trees), and requests "
                    "resumed after the verifier ran short of KV memory (per interval).",
                    [target(rate("ddtree_spec_drafts_total"), "drafted rounds / s"),
                     target("sum(increase(ddtree_fallbacks_total" + RI + "))", "AR fallbacks"),
                     target('sum(increase(ddtree_step_tree_nodes_bucket{le="0.0"}' + RI + "))", "steps gone AR (load)"),
                     target("sum(increase(ddtree_requests_resumed_total" + RI + "))", "resumed for KV memory")],
                    "short", overrides=[color("AR fallbacks", "red"),
                                        {"matcher": {"id": "byName", "options": "AR fallbacks"},
                                         "properties": [{"id": "custom.drawStyle", "value": "bars"},
                                                        {"id": "custom.fillOpacity", "value": 80},
                                                        {"id": "custom.axisPlacement", "value": "right"},
                                                        {"id": "decimals", "value": 0}]}]), 8, 8),
        (timeseries("Features to the drafter", "Positions of target features the verifier sends its drafter a "
                    "second: with a step's drafts (on the step's path, before its verify) and in Appends of their "
                    "own (prompts, and the owed features of sessions whose steps go AR under load); and how the "
                    "drafter received them: as rows of the verifier's feature pool (memory both map), or in the "
                    "messages (a drafter that cannot map the pool: another host or IPC namespace).",
                    [target(rate("ddtree_verify_feature_rows_sent_total", "call"), "sent with {{call}}"),
                     target(rate("ddtree_draft_feature_rows_received_total", "via"), "received via {{via}}")],
                    "short"), 8, 8),
    ]
    rounds = [
        (timeseries("Mean round time by phase", "Gateway view of one decode round, stacked: draft (drafter "
                    "forward), tree (tree build), verify (target forward), walk (acceptance walk and KV compaction), "
                    "server (the model services' host work around them: request decoding, host syncs, answer "
                    "encoding), transport (both ways over the round lane or gRPC, and orchestration). The stack "
                    "is the mean round time; all but draft and verify is the round's overhead.",
                    [target(mean("ddtree_round_phase_seconds", "phase"), "{{phase}}")], "s", stack=True,
                    overrides=[color(phase, c) for phase, c in PHASE_COLORS]), 8, 8),
        (timeseries("Round phase p90", "90th percentile of each phase's time per round.",
                    [target(quantile(0.9, "ddtree_round_phase_seconds", "phase"), "{{phase}} p90")], "s",
                    overrides=[color(f"{phase} p90", c) for phase, c in PHASE_COLORS]), 8, 8),
        (timeseries("Model forward time", "Server-side model forward per RPC (verifier: Step; drafter: "
                    "Draft, each session's draft in the verifier's DraftBatch, and Append, a prompt's features), "
                    "median and p99.",
                    [target(quantile(0.5, "ddtree_verify_forward_duration_seconds", "rpc"), "verify {{rpc}} p50"),
                     target(quantile(0.99, "ddtree_verify_forward_duration_seconds", "rpc"), "verify {{rpc}} p99"),
                     target(quantile(0.5, "ddtree_draft_forward_duration_seconds", "rpc"), "draft {{rpc}} p50"),
                     target(quantile(0.99, "ddtree_draft_forward_duration_seconds", "rpc"), "draft {{rpc}} p99")],
                    "s"), 8, 8),
    ]
    backends = [
        (timeseries("RPCs / s", "RPCs answered by the model services, by method.",
                    [target(rate("ddtree_verify_requests_total", "rpc"), "verify {{rpc}}"),
                     target(rate("ddtree_draft_requests_total", "rpc"), "draft {{rpc}}")], "reqps"), 8, 8),
        (timeseries("RPC errors / s", "RPCs answered with a gRPC status other than OK, by method and status "
                    "(CANCELLED: the caller gave up on the call; NOT_FOUND: session expired or unknown).",
                    [target(rate("ddtree_verify_requests_total", "rpc, code", '{code!="OK"}'),
                            "verify {{rpc}} {{code}}"),
                     target(rate("ddtree_draft_requests_total", "rpc, code", '{code!="OK"}'),
                            "draft {{rpc}} {{code}}")], "reqps"), 8, 8),
        (timeseries("RPC time p99", "Server-side time per RPC, queueing on the engine thread included.",
                    [target(quantile(0.99, "ddtree_verify_request_duration_seconds", "rpc"), "verify {{rpc}}"),
                     target(quantile(0.99, "ddtree_draft_request_duration_seconds", "rpc"), "draft {{rpc}}")],
                    "s"), 8, 8),
        (timeseries("Batch sizes", "Sessions' steps (trees and AR steps of Step calls) the verifier ran in one "
                    "forward, and sessions' blocks (the drafts of the verifier's DraftBatch calls) the drafter ran "
                    "in one, beside the requests the gateway sent in one Step call (its step scheduler). A step's "
                    "batch near the running requests means every running request rides each step; a forward's "
                    "batch below a step's means the service's --max-batch splits it. The verifier's prompt "
                    "forwards: the prompt chunks each took (requests starting together).",
                    [target(mean("ddtree_verify_batch_size"), "verifier mean"),
                     target(quantile(0.9, "ddtree_verify_batch_size"), "verifier p90"),
                     target(mean("ddtree_verify_prefill_batch_size"), "verifier prompts mean"),
                     target(mean("ddtree_draft_batch_size"), "drafter mean"),
                     target(mean("ddtree_step_batch_size", "rpc"), "gateway step {{rpc}} mean")], "short"), 8, 8),
        (timeseries("Collector pauses p99", "Python garbage-collector pauses of each process, any generation: "
                    "every request in flight on that process waits them out. The processes freeze their start-up "
                    "heap after warm-up, so pauses stay in the milliseconds; long ones mean a growing heap.",
                    [target(quantile(0.99, "ddtree_gc_pause_seconds"), "gateway"),
                     target(quantile(0.99, "ddtree_verify_gc_pause_seconds"), "verifier"),
                     target(quantile(0.99, "ddtree_draft_gc_pause_seconds"), "drafter")], "s"), 8, 8),
    ]
    sessions = [
        (timeseries("Active sessions", "Requests the gateway is decoding or queueing, and the sessions the model "
                    "services hold. Server sessions above the gateway's running requests for long means leaked "
                    "sessions (they expire after the session TTL).",
                    [target("sum(ddtree_requests_running)", "gateway running"),
                     target("sum(ddtree_requests_waiting)", "gateway waiting"),
                     target("sum(ddtree_verify_active_sessions)", "verifier sessions"),
                     target("sum(ddtree_draft_active_sessions)", "drafter sessions")], "short", decimals=0), 12, 8),
        (timeseries("Sessions expired by TTL", "Sessions the model services ended because they were idle longer "
                    "than --session-ttl: normally zero (the gateway ends its sessions).",
                    [target("sum(increase(ddtree_verify_sessions_expired_total" + RI + "))", "verifier"),
                     target("sum(increase(ddtree_draft_sessions_expired_total" + RI + "))", "drafter")],
                    "short", bars=True, decimals=0), 12, 8),
        (timeseries("Round lane connections", "Connections each model service's round lane holds: a client's step "
                    "calls take one, and on the drafter each session's appends one while it lives. A count that "
                    "only grows is a leak; at --max-lane-connections more are refused, and speculation goes AR.",
                    [target("sum by (instance) (ddtree_verify_lane_connections)", "verifier {{instance}}"),
                     target("sum by (instance) (ddtree_draft_lane_connections)", "drafter {{instance}}")],
                    "short", decimals=0), 12, 8),
    ]
    memory = [
        (timeseries("KV cache held by sessions", "Bytes of the verifier's target KV cache held by live sessions (each "
                    "grows with what it has committed), all its caches with those kept for the next sessions, and "
                    "their limit (--kv-cache-gib; 0: none but the device's); the drafter's context K/V cache "
                    "preallocated by live sessions.",
                    [target("sum by (instance) (ddtree_verify_kv_cache_bytes)", "verifier KV {{instance}}"),
                     target("sum by (instance) (ddtree_verify_kv_cache_pool_bytes)", "verifier KV pool {{instance}}"),
                     target("sum by (instance) (ddtree_verify_kv_cache_limit_bytes)",
                            "verifier KV limit {{instance}}"),
                     target("sum by (instance) (ddtree_draft_context_cache_bytes)",
                            "drafter context {{instance}}")], "bytes"), 12, 8),
        (timeseries("GPU memory", "torch's allocated (tensors) and reserved (caching allocator) memory on each "
                    "model service's GPU. Exported only by services running on CUDA.",
                    [target("sum by (instance) (ddtree_verify_gpu_memory_allocated_bytes)",
                            "verifier allocated {{instance}}"),
                     target("sum by (instance) (ddtree_verify_gpu_memory_reserved_bytes)",
                            "verifier reserved {{instance}}"),
                     target("sum by (instance) (ddtree_draft_gpu_memory_allocated_bytes)",
                            "drafter allocated {{instance}}"),
                     target("sum by (instance) (ddtree_draft_gpu_memory_reserved_bytes)",
                            "drafter reserved {{instance}}")], "bytes"), 12, 8),
    ]
    prefixes = [
        (timeseries("Prefix cache hits", "Share of prompt tokens each service's prefix cache held: the verifier's "
                    "K/V and features (not computed), the drafter's context (its features not sent). A chat's next "
                    "turn or a shared system prompt hits; fresh prompts do not.",
                    [target(f"{rate('ddtree_verify_prefix_cache_hit_tokens_total')} / "
                            f"{rate('ddtree_verify_prefix_cache_query_tokens_total')}", "verifier"),
                     target(f"{rate('ddtree_draft_prefix_cache_hit_tokens_total')} / "
                            f"{rate('ddtree_draft_prefix_cache_query_tokens_total')}", "drafter")], "percentunit"),
         12, 8),
        (timeseries("Prefix cache memory", "Device memory each service's prefix cache holds (within its "
                    "--prefix-cache-gib).",
                    [target("sum by (instance) (ddtree_verify_prefix_cache_bytes)", "verifier {{instance}}"),
                     target("sum by (instance) (ddtree_draft_prefix_cache_bytes)", "drafter {{instance}}")],
                    "bytes"), 12, 8),
    ]
    return [
        ("Overview", overview),
        ("Requests", requests),
        ("Latency", latency),
        ("Speculation", speculation),
        ("Round time", rounds),
        ("Backends (gRPC)", backends),
        ("Sessions", sessions),
        ("Memory", memory),
        ("Prefix caches", prefixes),
    ]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, items in rows():
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        x, line_height = 0, 0
        for panel, w, h in items:
            if x + w > 24:
                x, y = 0, y + line_height
                line_height = 0
            panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            panels.append(panel)
            x += w
            line_height = max(line_height, h)
        y += line_height
    for i, panel in enumerate(panels, 1):
        panel["id"] = i
        for ref, t in zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", panel.get("targets", [])):
            t["refId"] = ref
    return {
        "uid": "ddtree-serving",
        "title": "DDTree serving",
        "description": "Lossless DDTree speculative decoding: gateway requests and latency, speculation "
                       "(acceptance, tree size), round time by phase, model services, sessions and memory.",
        "tags": ["ddtree", "llm", "speculative-decoding"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "schemaVersion": 39,
        "version": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {"selected": False, "text": "Prometheus", "value": "prometheus"},
            "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": "",
            "skipUrlSync": False}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the committed JSON is up to date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).resolve()}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
