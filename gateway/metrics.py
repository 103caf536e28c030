"""The gateway's Prometheus metrics (docs/ARCHITECTURE.md §8). One registry per app instance, so tests and apps never
share state.

The acceptance length operators know from vLLM is `1 + rate(ddtree_spec_accepted_tokens_total) /
rate(ddtree_spec_drafts_total)`: every drafted round commits its accepted draft tokens plus one bonus token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.rounds import Round

FINISH_REASONS = ("stop", "length", "abort", "error")
SHED_REASONS = ("queue_full", "client_limit", "unavailable", "shutdown")
# Round and token latencies on CPU tests are milliseconds, on an 8B target a few ms to ~100 ms; prefill of a long
# prompt can take seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                 0.5, 1.0)
TREE_SIZE_BUCKETS = (1, 2, 4, 7, 8, 15, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)  # B-1 chains: 7, 15
ACCEPT_BUCKETS = tuple(range(1, 17)) + (20, 24, 32)  # tokens committed per round (accepted + bonus)
STEP_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # requests' calls in one batch call
PHASES = ("draft", "tree", "verify", "walk", "server", "transport")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # Request-level, like vLLM's vllm:* families.
        self.requests = Counter("ddtree_requests", "Finished requests, by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("ddtree_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ddtree_inter_token_latency_seconds",
                             "Per generated token after the first: round interval / tokens the round committed",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ddtree_e2e_request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS,
                             registry=r)
        # TTFT in two: waiting for a slot (and for memory), then the sessions' start and the prompt's prefill
        self.queue_time = Histogram("ddtree_request_queue_time_seconds", "Arrival to the start of the request's "
                                    "round loop: waiting for a decoding slot and for KV memory", buckets=TTFT_BUCKETS,
                                    registry=r)
        self.prefill_time = Histogram("ddtree_request_prefill_time_seconds", "Start of the round loop to the first "
                                      "token: the sessions' start and the prompt's prefill", buckets=TTFT_BUCKETS,
                                      registry=r)
        self.running = Gauge("ddtree_requests_running", "Requests decoding now", registry=r)
        self.waiting = Gauge("ddtree_requests_waiting", "Requests queued for a decoding slot", registry=r)
        # Speculation.
        self.drafts = Counter("ddtree_spec_drafts", "Rounds verified with a draft tree", registry=r)
        self.draft_nodes = Counter("ddtree_spec_draft_tokens", "Tree nodes proposed (root excluded)", registry=r)
        self.accepted = Counter("ddtree_spec_accepted_tokens", "Draft tokens accepted (bonus excluded)", registry=r)
        self.accepted_by_depth = Counter("ddtree_spec_accepted_tokens_per_depth",
                                         "Draft tokens accepted at each tree depth", ["depth"], registry=r)
        self.tree_size = Histogram("ddtree_spec_tree_size", "Tree nodes per drafted round", buckets=TREE_SIZE_BUCKETS,
                                   registry=r)
        self.acceptance_length = Histogram("ddtree_spec_acceptance_length",
                                           "Tokens committed per drafted round (accepted + bonus)",
                                           buckets=ACCEPT_BUCKETS, registry=r)
        self.phase = Histogram("ddtree_round_phase_seconds",
                               "Time per decode round by phase: the model services' device work as draft (the "
                               "drafter's forward), tree (the tree build), verify (the target's forward) and walk "
                               "(the acceptance walk and KV compaction); server their host work around it (request "
                               "decoding, host syncs, answer encoding), transport the rest (both ways over the round "
                               "lane or gRPC, and the gateway's orchestration)",
                               ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.step_calls = Histogram("ddtree_step_batch_size", "Requests in one step (rpc Step: the verifier's call)",
                                    ["rpc"], buckets=STEP_BUCKETS, registry=r)
        self.resumed = Counter("ddtree_requests_resumed", "Times a request's verifier session ran short of KV memory "
                               "and the request was resumed from its output so far once memory freed",
                               registry=r)
        self.fallbacks = Counter("ddtree_fallbacks", "Requests that fell back to autoregressive decoding "
                                 "because the drafter failed", registry=r)
        self.backend_up = Gauge("ddtree_backend_up", "1 when the backend reports SERVING", ["service"], registry=r)
        self.recoveries = Counter("ddtree_backend_recoveries", "Times a backend served again after the gateway had "
                                  "marked it down (restarted, or back from a failure)", ["service"], registry=r)
        self.shed = Counter("ddtree_requests_shed", "Requests answered 429 or 503 rather than served, by reason: "
                            "queue_full (the waiting queue at --max-waiting: 429), client_limit (a client at "
                            "--max-client-requests: 429), unavailable (the verifier down or out of sessions: 503), "
                            "shutdown (arriving, or still in flight when the shutdown grace "
                            "ended: 503)", ["reason"], registry=r)
        # Known label values exist from the start, so rate() sees the first increment.
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        for service in ("verifier", "drafter"):
            self.backend_up.labels(service)
            self.recoveries.labels(service)
        for reason in SHED_REASONS:
            self.shed.labels(reason)
        # the children observed every round, looked up once rather than by labels() at every observation
        self._phases = {phase: self.phase.labels(phase) for phase in PHASES}
        self._by_depth: list[Counter] = []  # accepted_by_depth's child for depth d at index d - 1, as depths are met

    def observe_round(self, rnd: Round) -> None:
        """Speculation and phase metrics of one decode round (round 0, the prefill, is covered by TTFT)."""
        if rnd.index == 0:
            return
        t = rnd.timings
        forward, walk, drafting, tree = (t.get(k, 0.0) for k in ("verify_s", "walk_s", "draft_s", "tree_s"))
        verify, draft = forward + walk, drafting + tree  # each service's device work, which its total bounds
        phases = self._phases
        phases["verify"].observe(forward)
        phases["walk"].observe(walk)
        if rnd.tree_size:
            phases["draft"].observe(drafting)
            phases["tree"].observe(tree)
            # On a request's last round the loop may have trimmed tokens at a stop token or max_tokens, so that
            # round counts only what was committed to the output.
            accepted = rnd.accepted - 1
            self.drafts.inc()
            self.draft_nodes.inc(rnd.tree_size)
            self.accepted.inc(accepted)
            while len(self._by_depth) < accepted:
                self._by_depth.append(self.accepted_by_depth.labels(str(len(self._by_depth) + 1)))
            for child in self._by_depth[:accepted]:
                child.inc()
            self.tree_size.observe(rnd.tree_size)
            self.acceptance_length.observe(rnd.accepted)
        # the services' own totals bound their compute; backends that report none (in-process) have no server part
        server = max(0.0, t.get("draft_server_s", draft) - draft) + max(0.0, t.get("verify_server_s", verify) - verify)
        phases["server"].observe(server)
        # every round, as verify, walk, server and transport: their means stack to a round's
        phases["transport"].observe(max(0.0, t.get("round_s", 0.0) - draft - verify - server))

    def render(self) -> bytes:
        return generate_latest(self.registry)
