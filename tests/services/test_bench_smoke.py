"""Every script in bench/ at a smoke size on the CPU, each as CI would rot it: run as `python bench/<script>.py` in a
process of its own, on the bundled demo pair (or tiny random shapes where the script takes a shape), a prompt or two
and a few tokens, its JSON (or its printed report) read back for the fields a healthy run has: exactness where the
script reports it, finite positive timings, each requested case present. The scripts that talk to running services
(long_prompt_ttft.py, soak.py) run against one `ddtree serve` on the demo pair. The two profilers of CUDA-only Triton
kernels (profile_batch_attention.py, profile_invariant.py) say so on a machine without CUDA and list, untimed, what
they would time. Scripts smoked elsewhere: concurrent_load.py and capacity.py (test_load_bench.py), step_host.py
(test_step_host_bench.py), hybrid_cost.py (tests/unit/test_hybrid.py); load_client.py is their shared module, not a
script. test_every_bench_script_has_a_smoke_run keeps that list whole."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.models import resolve_pair
from tests.services import REPO_ROOT, ServeStack, serve_stack

TIMEOUT_S = 300  # a deadline on a slow, busy CI machine, not a measurement: each run takes seconds
TARGET, DRAFTER = resolve_pair(None, None)

# bench/ scripts -> where their smoke run is; this file's own, then the others'
SMOKED_HERE = {
    "constrained_trees.py", "hf_distance.py", "long_prompt_ttft.py", "profile_batch_attention.py", "profile_decode.py",
    "profile_draft.py", "profile_invariant.py", "profile_round.py", "random_pair.py", "soak.py", "tp_equality.py",
    "tree_walk.py", "warm_up_time.py",
}
SMOKED_ELSEWHERE = {
    "concurrent_load.py": "tests/services/test_load_bench.py",
    "capacity.py": "tests/services/test_load_bench.py",
    "step_host.py": "tests/services/test_step_host_bench.py",
    "hybrid_cost.py": "tests/unit/test_hybrid.py",
}
MODULES = {"load_client.py"}  # imported by the load benches (a script's folder is on its sys.path), never run


def _bench(script: str, *args: str) -> str:
    """`python bench/<script> args...` from the repository's root -> its output (stdout and stderr); fails with
    the output unless it exits 0."""
    assert script in SMOKED_HERE, script
    done = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    return output


def _finite(*values: float) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def test_every_bench_script_has_a_smoke_run() -> None:
    scripts = {path.name for path in (REPO_ROOT / "bench").glob("*.py")}
    assert scripts == SMOKED_HERE | set(SMOKED_ELSEWHERE) | MODULES, "a bench script without a smoke run"
    for script, test in SMOKED_ELSEWHERE.items():
        assert script.removesuffix(".py") in (REPO_ROOT / test).read_text(), (script, test)
    for module in MODULES:
        assert "__main__" not in (REPO_ROOT / "bench" / module).read_text(), f"{module} became a script"


def test_constrained_trees(tmp_path: Path) -> None:
    out = tmp_path / "constrained.json"
    _bench("constrained_trees.py", "--budgets", "8", "--num-requests", "1", "--max-new-tokens", "8", "--device", "cpu",
           "--dtype", "float32", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["settings"]["requests"] == 1 and result["hardware"]["device"] == "cpu"
    runs = result["runs"]
    assert set(runs) == {"ar", "ddtree-8-constrained", "ddtree-8-free"}
    for name, r in runs.items():
        assert r["matches_ar"] == 1.0, name  # every arm's JSON equals AR's under the same grammar
        assert 0 < r["tokens"] <= 8 and r["rounds"] > 0, name
        assert r["tau"] >= 1 and r["tokens_per_s"] > 0 and r["round_ms"] > 0 and _finite(r["seconds"]), name
    assert runs["ar"]["tree_nodes"] == 0 and runs["ar"]["tau"] == 1
    assert runs["ddtree-8-constrained"]["constrained_trees"] is True
    assert runs["ddtree-8-free"]["constrained_trees"] is False
    for name in ("ddtree-8-constrained", "ddtree-8-free"):
        assert 0 < runs[name]["tree_nodes"] <= 8 and runs[name]["tree_ms"] > 0
    ratios = result["constrained_over_free"]["8"]
    assert ratios["tau"] > 0 and ratios["tokens_per_s"] > 0 and _finite(*ratios.values())


def test_hf_distance(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    _bench("hf_distance.py", "--device", "cpu", "--dtype", "float32", "--num-prompts", "1", "--max-new-tokens", "8",
           "--out", str(out))
    result = json.loads(out.read_text())
    # fp32: the engine's batch-1 AR decode is HF generate's, token for token
    assert result["equal_share"] == 1.0 and result["first_difference"] == [None]
    assert result["median_first_difference"] is None and result["settings"]["num_prompts"] == 1
    assert result["tokens"]["engine"] == result["tokens"]["hf"] > 0
    assert _finite(*result["seconds"].values())


def test_tree_walk(tmp_path: Path) -> None:
    out = tmp_path / "walk.json"
    _bench("tree_walk.py", "--budgets", "8,16", "--temperatures", "1,0.85", "--penalties", "0,1", "--num-prompts", "1",
           "--max-new-tokens", "16", "--out", str(out))
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["budget"], r["temperature"], r["penalty"]) for r in runs] == [("chain", 1.0, 0.0)] + [
        (b, t, p) for b in (8, 16) for t in (1.0, 0.85) for p in (0.0, 1.0)]
    walked = runs[0]["tokens"]
    for r in runs:
        # every policy walks the same answer: the same tokens, in rounds of at least one (the bonus)
        assert r["tokens"] == walked > 0 and 0 < r["rounds"] <= r["tokens"], r
        assert r["tau"] >= 1 and _finite(r["tau"]), r
    assert result["training_tau_estimate"] >= 1 and _finite(result["training_tau_estimate"])


def test_random_pair(tmp_path: Path) -> None:
    """The pair at the tiny shape is written in the real formats, with the demo's tokenizer, and the engines load it
    and speculate over it."""
    import asyncio

    from ddtree.local import load_local
    from gateway.rounds import Speculation, run_rounds
    from protos.types import SamplingParams
    from runtime.shapes import SHAPES

    out = tmp_path / "pair"
    _bench("random_pair.py", "tiny", str(out), "--device", "cpu")
    shape = SHAPES["tiny"]
    config = json.loads((out / "target" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / "target" / name).is_file(), name
    verifier, drafter = load_local(str(out / "target"), str(out / "drafter"), "cpu", torch.float32)
    assert drafter.engine.block_size == shape["block_size"]

    async def generate() -> list[int]:
        rounds = run_rounds(verifier, drafter, list(range(1, 17)), SamplingParams(), Speculation("ddtree", 8), 8, [])
        return [t async for r in rounds for t in r.tokens]

    assert len(asyncio.run(generate())) == 8  # no EOS: a generation ends at its limit


@pytest.mark.parametrize("pair", ["demo", "random:tiny"])
def test_tp_equality(pair: str, tmp_path: Path) -> None:
    """The sharded verifier (TP = 2, gloo ranks on the CPU) against TP = 1, fp32: equal outputs."""
    out = tmp_path / "tp.json"
    common = ("--tp", "2", "--dtype", "float32", "--device", "cpu", "--prompts", "1", "--out", str(out))
    if pair == "demo":
        _bench("tp_equality.py", TARGET, DRAFTER, "--max-new-tokens", "8", *common)
        report = json.loads(out.read_text())
        assert report["tp"] == 2 and report["prompts"] == 1
        assert report["identical_prompts"] == {"ar": 1, "chain": 1, "ddtree": 1}
        assert report["sharded_equals_its_own_ar"] == {"ar": 1, "chain": 1, "ddtree": 1}
    else:
        _bench("tp_equality.py", "--random", "tiny", "--rounds", "2", *common)
        report = json.loads(out.read_text())
        assert report["target"] == "random:tiny" and report["identical_sequences"] == 1
        assert report["first_divergence"] == [None] and report["tokens_per_sequence"][0] >= 3  # prefill + 2 rounds


PROFILE_LINE = r"=== {what}: (?:step|draft) ([\d.]+) ms wall \(([\d.]+)x the bound\), ([\d.]+) ms of device kernels"


@pytest.mark.parametrize("batch", [1, 2])
def test_profile_decode(batch: int) -> None:
    """A verifier step's profile on the demo target: each tree size (0: AR) and each prefill, one session and
    (batch 2, sampled with top-p) a batched step."""
    args = ["--device", "cpu", "--dtype", "float32", "--nodes", "0,7", "--context", "32", "--rows", "3",
            "--prefill", "16", "--batch", str(batch), "--prompts", str(batch)]
    temperature = "0.0"
    if batch > 1:
        temperature = "0.7"
        args += ["--temperature", temperature, "--top-p", "0.9"]
    output = _bench("profile_decode.py", TARGET, *args)
    assert re.search(r"weight-streaming bound [\d.]+ ms", output) and "verifier path fused" in output
    for nodes in (0, 7):
        what = rf"{nodes} nodes, {batch} session\(s\), T={temperature} top_p=[\d.]+"
        found = re.search(PROFILE_LINE.format(what=what), output)
        assert found and float(found.group(1)) > 0, output[-3000:]
    prefills = re.findall(r"=== prefill of \d+ prompt\(s\) of 16 tokens (one by one|in one forward).*: ([\d.]+) ms "
                          r"wall", output)
    assert [how for how, _ in prefills] == (["one by one", "in one forward"] if batch > 1 else ["one by one"])
    assert all(float(ms) > 0 for _, ms in prefills)


@pytest.mark.parametrize("batch", [1, 2])
def test_profile_draft(batch: int) -> None:
    """A draft call's profile (batch 1), a DraftBatch step's (batch 2), random weights at the tiny shape."""
    output = _bench("profile_draft.py", "tiny", "--device", "cpu", "--dtype", "float32", "--budgets", "7,15",
                    "--context", "32", "--rows", "3", "--batch", str(batch))
    assert re.search(r"weight-streaming bound [\d.]+ ms", output)
    for budget in (7, 15):
        what = rf"budget {budget}" + (f", batch {batch}" if batch > 1 else "")
        found = re.search(PROFILE_LINE.format(what=what), output)
        assert found and float(found.group(1)) > 0, output[-3000:]


def test_profile_round() -> None:
    """Each part of a round on the demo pair, the kernels' census of each mode and the host's profile (on the CPU
    the profiler's operators stand for the kernels)."""
    output = _bench("profile_round.py", "--device", "cpu", "--budget", "8", "--context", "32", "--rows", "3",
                    "--census", "8", "--host-rounds", "8")
    assert "verifier fused" in output
    for part in ("draft call (block + tree)", "block forward", "tree build", "verify round", "AR step"):
        found = re.search(rf"=== {re.escape(part)}: ([\d.]+) ms wall per call, (\d+) kernels", output)
        assert found and float(found.group(1)) > 0 and int(found.group(2)) > 0, part
    for mode in ("ar", "chain", "ddtree 8"):
        found = re.search(rf"=== {mode}: (\d+) rounds, (-?[\d.]+) ms wall per round, ([\d.]+) kernels per round",
                          output)
        assert found and int(found.group(1)) > 0 and float(found.group(3)) > 0, mode
    assert re.search(r"=== host profile: \d+ rounds of ddtree 8", output)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA gets")
def test_profile_batch_attention_without_cuda() -> None:
    output = _bench("profile_batch_attention.py", "--shape", "tiny", "--batches", "2", "--nodes", "1,4",
                    "--contexts", "16,4096", "--targets", "8,64")
    assert "no CUDA device: the batched tree attention is a CUDA kernel; its plans are listed, not timed" in output
    cases = re.split(r"^== ", output, flags=re.M)[1:]
    assert [c.splitlines()[0].split(":")[0] for c in cases] == [
        f"batch 2, {n} rows a tree, context {c}" for n in (1, 4) for c in (16, 4096)]
    for case in cases:
        plans = [line for line in case.splitlines()[1:] if line.strip()]
        assert plans and all(line.strip().startswith("splits") and "not timed" in line for line in plans)
        assert sum(line.endswith("<- batch_plan") for line in plans) == 1  # the chosen plan, marked once


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA gets")
def test_profile_invariant_without_cuda() -> None:
    output = _bench("profile_invariant.py", "tiny", "--rows", "1,16", "--tiles", "16x32x64w4s2")
    assert "no CUDA device: the projections are CUDA kernels" in output and "not timed" in output
    for name in ("qkv", "o", "gate_up", "down", "lm_head"):
        line = re.search(rf"^{name}\s+\[(\d+), (\d+)\]: (.*)$", output, flags=re.M)
        assert line, name
        assert re.findall(r"(\d+x\d+x\d+w\d+s\d+) \(splits (\d+)\)", line.group(3))[1][0] == "16x32x64w4s2"


def test_warm_up_time(tmp_path: Path) -> None:
    out = tmp_path / "warm_up.json"
    output = _bench("warm_up_time.py", "--device", "cpu", "--sessions", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["load_s"] > 0 and result["warm_up_s"] > 0
    assert result["graphs"] == 0  # no CUDA graphs on the CPU: nothing captured, so no capture stages
    assert isinstance(result["dynamo"], dict) and isinstance(result["stages"], dict)
    assert "[warm-up-time] load" in output and "[warm-up-time] warm-up" in output


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServeStack]:
    with serve_stack(tmp_path_factory.mktemp("bench_smoke"), "--max-sessions", "4", "--health-interval", "0.5",
                     "--shutdown-grace", "0") as running:
        yield running


def test_long_prompt_ttft(stack: ServeStack, tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    _bench("long_prompt_ttft.py", "--gateways", stack.url, "--lengths", "20", "--repeat", "1", "--max-tokens", "4",
           "--out", str(out))
    result = json.loads(out.read_text())
    assert result["max_tokens"] == 4 and list(result["gateways"]) == [stack.url]
    summary = result["gateways"][stack.url]["20"]
    assert summary["prompt_tokens"] >= 20 and len(summary["runs"]) == 1
    assert summary["first_token_s"] > 0 and summary["last_token_s"] >= summary["first_token_s"]
    for r in [*summary["runs"], summary["first_of_its_length"]]:
        assert 1 <= r["completion_tokens"] <= 4 and r["first_s"] > 0 and r["last_s"] > 0
        assert r["rounds_s"].get("phase[verify]", 0) > 0 and _finite(*r["rounds_s"].values())


def test_soak(stack: ServeStack, tmp_path: Path) -> None:
    """Two clients for two seconds: every request ends well, every process's memory is read, and once they stop
    nothing is left running or held (sessions, requests, the sessions' append connections from the verifier to the
    drafter), and no request fell back to AR."""
    started = dict(re.findall(r"\[serve\] (\w+) started \(pid (\d+)\)", stack.log()))
    pids = {"gateway": started["gateway"], "verifier": started["verify"], "drafter": started["draft"]}
    out = tmp_path / "soak.json"
    _bench("soak.py", "--gateway", stack.url, "--verifier-metrics", stack.verifier_metrics, "--drafter-metrics",
           stack.drafter_metrics, "--pids", ",".join(f"{k}={v}" for k, v in pids.items()), "--clients", "2",
           "--duration", "2", "--max-tokens", "8", "--interval", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["requests"]["ok"] >= 2 and result["requests"]["error"] == {}
    assert result["config"]["clients"] == 2 and len(result["samples"]) >= 2
    assert set(result["rss_bytes"]) == set(pids)
    for name, rss in result["rss_bytes"].items():
        assert rss["start"] > 0 and rss["end"] > 0 and rss["max"] >= max(rss["start"], rss["end"]), name
    for when in ("start", "end"):
        gauges = result["gauges"][when]
        assert all(v is not None for v in gauges.values()), gauges  # every source answered
        for name in ("ddtree_requests_running", "ddtree_verify_active_sessions", "ddtree_draft_active_sessions",
                     "ddtree_fallbacks_total"):
            assert gauges[name] == 0, (when, name)
    # each service's lane holds its one client's step calls' connection, none for a session gone
    assert result["gauges"]["end"]["ddtree_verify_lane_connections"] == 1
    assert result["gauges"]["end"]["ddtree_draft_lane_connections"] == 1
