"""A step's host and transport time through the real services: `ddtree serve` on loopback on the CPU, with a model
pair whose forwards cost almost nothing, loaded by greedy streaming clients at each client count, so that what a
step costs outside the model forwards (the gateway's gather and hand-overs, the calls and their messages, the
services' batching, answers and walks) is what is left to see.

    python bench/step_host.py --clients 1,16,64 --modes ar,ddtree --tokens 64 --requests 3 --out FILE.json
    python bench/step_host.py --smoke --out FILE.json          # CI size: 1 and 4 clients, 24 tokens, 2 requests
    python bench/step_host.py --target P/target --drafter P/drafter --device cuda --dtype bfloat16 ...  # a real pair

The pair is built in a temporary directory from seeded random weights and saved through the real formats: a
1-layer Qwen3 target (hidden 32, fp32) with a character-level tokenizer of 44 tokens and the ChatML template, and a
1-layer DFlash drafter tapping it (block 8). The stack runs with room for every client at once (`--max-sessions`,
`--max-running`, `--max-batch` at the largest client count), every ddtree step drafting its
full trees (`--no-fit-trees`: this pair's random drafter has nothing accepted, so the verifier's choice would run
every step AR; with --target, a real pair, the verifier chooses), and one torch thread per service
(OMP_NUM_THREADS=1: tiny forwards are fastest so, and the services then take one core at a time). Each client sends --requests requests of --tokens tokens
(`ignore_eos`) back to back, all clients starting at once, each request a prompt of its own; one warm-up level at
the largest count first, per mode.

Reported per mode and client count, from the gateway's and the services' Prometheus metrics over the level:
- `step_ms`: a request's round interval, what a step lasts as the requests see it: the gateway's
  ddtree_inter_token_latency_seconds sum over its decode rounds (ddtree_round_phase_seconds count). A round is one
  Step call to the verifier; in ddtree mode the verifier asks the drafter for the step's trees in it (one
  DraftBatch) before its verify forward.
- `forward_ms`: the model forwards of that round, the verifier's (phase `verify`) and the drafter's (phase `draft`):
  each call in a batch reports its batch's forward, so these are the batches' forwards weighted by their calls.
- `host_ms` = step_ms - forward_ms: everything outside the forwards, split by the gateway's round phases into
  `tree_ms` (the drafter's tree build), `walk_ms` (the verifier's acceptance walk and commit: on a GPU device work,
  here host work), `server_ms` (the services' host work around them: decoding the call, batching, answering, and a
  call's wait behind the batch before it on the engine: an AR step sent behind the one in flight waits there) and
  `transport_ms` (the rest of the round: the gateway's gather and hand-overs, both ways over the round lane). The
  phases are means of per-round values clamped at 0, so they add up to about, not exactly, step_ms.
- `wall_per_step_ms`: the level's wall time over its Step calls (prefills, session starts and ends included),
  tokens/s, steps/s, the mean requests a step (ddtree_step_batch_size); `draft_steps`: the drafter's forwards of
  a step's drafts (ddtree_draft_batch_size), one a drafting step where --max-batch holds every client.
- CPU time by process over the level (from /proc): each service's and the load generator's (this process) CPU
  milliseconds a step, and each one's share of the machine (wall x cores): on a small machine the clients compete
  with the services for the cores, and `client_cpu_share` says how much; `other_cpu_share` (the machine's busy time
  outside these four processes, /proc/stat) and the load average say whether anything else ran meanwhile.

--profile runs the gateway under cProfile through the measured levels (a sitecustomize on the stack's PYTHONPATH
installs it in the gateway's process, SIGUSR1 turns it on and off around each level, and it is written at exit) and
writes its top functions beside --out, as FILE.gateway_profile.txt (by own time, then by cumulative time); cProfile
slows Python down, so that run's timings are not the unprofiled ones.
--serve-args="..." appends more `ddtree serve` options (split as a shell would), e.g. --serve-args=--no-lanes.
One JSON (--out) with a header (command, hardware, date, commit, settings) and a row per mode and client count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch

# bench/'s own module (a script's folder is on its sys.path)
from load_client import (
    Stream,
    difference,
    histogram_mean,
    prompt,
    sample_key,
    scrape,
    stream_chat,
)
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from ddtree.bench_gateway import served_model
from ddtree.serve import free_ports
from draft_server.dflash import DFlashDrafter, init_drafter_weights, save_drafter
from draft_server.dflash_config import DFlashConfig
from training.demo.tokenizer import CHAT_TEMPLATE, save_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = {"ar": "off", "ddtree": "ddtree"}  # --modes names -> the request's speculation.mode
FULL = {"clients": "1,16,64", "tokens": 64, "requests": 3}
SMOKE = {"clients": "1,4", "tokens": 24, "requests": 2}
START_DEADLINE_S = 240.0
STOP_DEADLINE_S = 60.0
# ChatML specials first (ids 0-3), then single characters; the drafter's mask token last
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz") + [" ", "\n", ".", ",", "!", "?", "'", "-", ":", "0", "1", "2", "3"]
TOKENS = SPECIALS + CHARS + ["<|mask|>"]
HIDDEN, BLOCK, CONTEXT = 32, 8, 2048  # a session holds a context of CONTEXT - the largest tree
PHASES = ("draft", "verify", "tree", "walk", "server", "transport")
# the gateway's process runs this at start-up under --profile (sitecustomize); the others ignore it. SIGUSR1 turns
# the profiler on and off (the bench's levels alone), and it is written at exit.
PROFILE_HOOK = """
import os, sys
if os.environ.get("STEP_HOST_PROFILE") and sys.argv[:2] == ["-m", "gateway"]:  # python -m ddtree.cli gateway
    import atexit, cProfile, pstats, signal
    _profile, _on = cProfile.Profile(), [False]
    def _toggle(*_) -> None:
        (_profile.disable if _on[0] else _profile.enable)()
        _on[0] = not _on[0]
    def _write() -> None:
        _profile.disable()
        with open(os.environ["STEP_HOST_PROFILE"], "w") as out:
            for order in ("tottime", "cumulative"):
                try:
                    pstats.Stats(_profile, stream=out).sort_stats(order).print_stats(40)
                except TypeError:  # never turned on
                    pass
    signal.signal(signal.SIGUSR1, _toggle)
    atexit.register(_write)
"""


def build_pair(root: Path) -> tuple[Path, Path]:
    """The cheapest architecture-true pair: root/target (Qwen3, 1 layer, hidden 32, a 44-token character tokenizer,
    ChatML) and root/drafter (DFlash, 1 layer, tapping the target's layer 0), seeded random fp32 weights."""
    torch.manual_seed(0)
    vocab = len(TOKENS)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=CONTEXT, initializer_range=0.25,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(root / "target")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[], unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|mask|>"])
    hf.chat_template = CHAT_TEMPLATE
    save_tokenizer(hf, root / "target")
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=vocab, block_size=BLOCK, mask_token_id=vocab - 1, target_layer_ids=[0],
        num_target_layers=1, max_position_embeddings=CONTEXT))
    init_drafter_weights(drafter, std=0.25, seed=1)
    save_drafter(drafter, root / "drafter", dtype=torch.float32)
    return root / "target", root / "drafter"


class Stack:
    """`ddtree serve` on loopback (CPU, fp32) over the pair, with its metrics ports; stopped by stop()."""

    def __init__(self, target: Path, drafter: Path, sessions: int, budget: int, log_path: Path,
                 profile: Path | None, device: str = "cpu", dtype: str = "float32",
                 extra: list[str] | None = None) -> None:
        port, verify_metrics, draft_metrics = free_ports(3)
        self.url = f"http://127.0.0.1:{port}"
        self.metrics = (self.url, f"http://127.0.0.1:{verify_metrics}", f"http://127.0.0.1:{draft_metrics}")
        self.log_path = log_path
        self.flags = ["--device", device, "--dtype", dtype, "--max-sessions", str(sessions), "--max-running",
                      str(sessions), "--max-batch", str(sessions),
                      "--budget", str(budget), "--health-interval", "1",
                      "--shutdown-grace", "0", *(extra or [])]
        cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--target", str(target), "--drafter", str(drafter),
               "--port", str(port), "--verify-metrics-port", str(verify_metrics), "--draft-metrics-port",
               str(draft_metrics), *self.flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if profile is not None:
            hook = log_path.parent / "profile_hook"
            hook.mkdir(exist_ok=True)
            (hook / "sitecustomize.py").write_text(PROFILE_HOOK)
            env |= {"STEP_HOST_PROFILE": str(profile),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))}
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.pids: dict[str, int] = {}
        self.profiled = profile is not None

    def wait_ready(self) -> str:
        """Until the gateway's /health says both services serve -> the served model's name."""
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ddtree serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if json.loads(reply.read()).get("status") == "ok":
                        self.pids = service_pids(self.process.pid)
                        return served_model(self.url)
            except (OSError, ValueError):
                pass  # not listening yet, or 503 while the services load
            time.sleep(0.2)
        raise RuntimeError(f"ddtree serve not ready after {START_DEADLINE_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def toggle_profile(self) -> None:
        """Turns the gateway's profiler on, or off again (--profile: PROFILE_HOOK)."""
        if self.profiled:
            os.kill(self.pids["gateway"], signal.SIGUSR1)

    def stop(self) -> None:
        """Ctrl-C, as a person stops it (the gateway then writes its profile, if any)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def service_pids(serve_pid: int) -> dict[str, int]:
    """`ddtree serve`'s children by service (gateway, verify, draft): each becomes `python -m ddtree.cli NAME`."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == serve_pid and "ddtree.cli" in argv:
            pids[argv[argv.index("ddtree.cli") + 1]] = int(entry.name)
    return pids


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (its threads included), and of this one as `client`."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            seconds[name] = float("nan")
    times = os.times()
    seconds["client"] = times.user + times.system
    # the whole machine's busy time (/proc/stat's first line: user nice system idle iowait irq softirq steal ...)
    jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    seconds["machine"] = (sum(jiffies) - jiffies[3] - jiffies[4]) / tick
    return seconds


def body(model: str, key: str, mode: str, args: argparse.Namespace) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt(key, args.prompt_words)}],
            "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
            "speculation": {"mode": MODES[mode], **({"budget": args.budget} if mode == "ddtree" else {})}}


async def run_clients(url: str, model: str, mode: str, clients: int, requests: int, tag: str,
                      args: argparse.Namespace) -> list[Stream]:
    """`clients` clients at once, each sending `requests` requests back to back -> every stream."""
    async def client(http: httpx.AsyncClient, c: int) -> list[Stream]:
        return [await stream_chat(http, url, body(model, f"{tag}/{mode}/{clients}/{c}/{r}", mode, args))
                for r in range(requests)]

    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=clients + 1)) as http:
        per_client = await asyncio.gather(*(client(http, c) for c in range(clients)))
    return [s for streams in per_client for s in streams]


def per_round(delta: dict[str, float], phase: str) -> float | None:
    mean = histogram_mean(delta, "ddtree_round_phase_seconds", phase=phase)
    return None if mean is None else 1000 * mean


def level(stack: Stack, model: str, mode: str, clients: int, args: argparse.Namespace) -> dict:
    """One measurement -> its row."""
    before, cpu_before = [scrape(u) for u in stack.metrics], cpu_seconds(stack.pids)
    stack.toggle_profile()
    start = time.perf_counter()
    streams = asyncio.run(run_clients(stack.url, model, mode, clients, args.requests, "level", args))
    wall = time.perf_counter() - start
    stack.toggle_profile()
    cpu = {k: v - cpu_before[k] for k, v in cpu_seconds(stack.pids).items()}
    machine = cpu.pop("machine")
    gateway, verifier, drafter = (difference(scrape(u), b) for u, b in zip(stack.metrics, before))
    failed = [s.error for s in streams if s.error is not None]
    tokens = sum(s.completion_tokens for s in streams if s.error is None)
    steps = gateway.get(sample_key("ddtree_step_batch_size_count", rpc="Step"), 0.0)
    draft_steps = drafter.get("ddtree_draft_batch_size_count", 0.0)
    rounds = gateway.get(sample_key("ddtree_round_phase_seconds_count", phase="verify"), 0.0)
    step_ms = 1000 * gateway.get("ddtree_inter_token_latency_seconds_sum", 0.0) / rounds if rounds else None
    phases = {p: per_round(gateway, p) for p in PHASES}
    forward_ms = (phases["verify"] or 0.0) + (phases["draft"] or 0.0)
    verifier_forward = histogram_mean(verifier, "ddtree_verify_forward_duration_seconds", rpc="Step")
    drafter_forward = histogram_mean(drafter, "ddtree_draft_forward_duration_seconds", rpc="Draft")
    cores = os.cpu_count() or 1
    row = {
        "mode": mode, "clients": clients, "requests": len(streams), "errors": len(failed),
        "error_samples": list(dict.fromkeys(failed))[:5], "tokens": tokens,
        "expected_tokens": clients * args.requests * args.tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "steps": int(steps), "draft_steps": int(draft_steps), "steps_per_s": steps / wall, "rounds": int(rounds),
        "mean_step_batch": histogram_mean(gateway, "ddtree_step_batch_size", rpc="Step"),
        "mean_verify_batch": histogram_mean(verifier, "ddtree_verify_batch_size"),
        "mean_draft_batch": histogram_mean(drafter, "ddtree_draft_batch_size"),
        "tau": (1 + gateway.get("ddtree_spec_accepted_tokens_total", 0.0) / drafts
                if (drafts := gateway.get("ddtree_spec_drafts_total", 0.0)) else None),
        # the node count the verifier's load-adaptive fit cut each step's trees to (a request's budget is its ceiling)
        "fit_nodes": histogram_mean(verifier, "ddtree_step_tree_nodes"),
        "wall_per_step_ms": 1000 * wall / steps if steps else None,
        "step_ms": step_ms, "forward_ms": forward_ms,
        "host_ms": None if step_ms is None else step_ms - forward_ms,
        "verify_forward_ms": phases["verify"], "draft_forward_ms": phases["draft"], "tree_ms": phases["tree"],
        "walk_ms": phases["walk"], "server_ms": phases["server"], "transport_ms": phases["transport"],
        "round_phases_sum_ms": sum(v for v in phases.values() if v is not None),
        "verifier_forward_ms": None if verifier_forward is None else 1000 * verifier_forward,
        "drafter_forward_ms": None if drafter_forward is None else 1000 * drafter_forward,
        "cpu_s": cpu,
        "cpu_ms_per_step": {k: 1000 * v / steps for k, v in cpu.items()} if steps else None,
        "cpu_share": {k: v / (wall * cores) for k, v in cpu.items()},
        "client_cpu_share": cpu["client"] / (wall * cores),
        # other processes' share of the cores meanwhile: on a shared machine, what the level competed with
        "other_cpu_share": max(0.0, machine - sum(cpu.values())) / (wall * cores),
        "load_average": os.getloadavg()[0],
    }
    return row


def table(rows: list[dict]) -> str:
    def f(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    head = (f"{'mode':<7}{'clients':>8}{'tok/s':>9}{'steps/s':>9}{'batch':>7}{'step ms':>9}{'fwd ms':>8}"
            f"{'host ms':>9}{'tree':>7}{'walk':>7}{'server':>8}{'transp':>8}{'gw cpu':>8}{'ver cpu':>8}"
            f"{'dr cpu':>8}{'cl cpu':>8}{'client%':>8}{'other%':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cpu = r["cpu_ms_per_step"] or {}
        lines.append(
            f"{r['mode']:<7}{r['clients']:>8}{f(r['tokens_per_s'], 1):>9}{f(r['steps_per_s'], 1):>9}"
            f"{f(r['mean_step_batch'], 1):>7}{f(r['step_ms']):>9}{f(r['forward_ms']):>8}{f(r['host_ms']):>9}"
            f"{f(r['tree_ms']):>7}{f(r['walk_ms']):>7}{f(r['server_ms']):>8}{f(r['transport_ms']):>8}"
            f"{f(cpu.get('gateway')):>8}{f(cpu.get('verify')):>8}{f(cpu.get('draft')):>8}{f(cpu.get('client')):>8}"
            f"{f(100 * r['client_cpu_share'], 0):>8}{f(100 * r['other_cpu_share'], 0):>7}")
    lines.append("(ms per step; gw/ver/dr/cl cpu: the gateway's, verifier's, drafter's and load generator's CPU ms "
                 "per Step call; client%, other%: the load generator's and other processes' share of all cores)")
    return "\n".join(lines)


def commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", help=f"comma-separated client counts (default {FULL['clients']}; "
                                     f"--smoke: {SMOKE['clients']})")
    p.add_argument("--tokens", type=int, help=f"tokens each request generates (default {FULL['tokens']}; "
                                              f"--smoke: {SMOKE['tokens']})")
    p.add_argument("--requests", type=int, help=f"requests each client sends back to back (default "
                                                f"{FULL['requests']}; --smoke: {SMOKE['requests']})")
    p.add_argument("--modes", default="ar,ddtree", help="comma-separated: ar, ddtree")
    p.add_argument("--budget", type=int, default=16, help="tree nodes a ddtree request asks for")
    p.add_argument("--prompt-words", type=int, default=6, help="words of each request's prompt")
    p.add_argument("--smoke", action="store_true", help="a CI-size run (the defaults above)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the gateway for the whole run; its top functions go beside --out")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--target", type=Path, help="a target directory to serve instead of the built 1-layer pair "
                   "(with --drafter: the host time at a real pair's shapes, e.g. `ddtree embed-pair`'s on a GPU)")
    p.add_argument("--drafter", type=Path, help="the drafter for --target")
    p.add_argument("--device", default="cpu", help="the stack's device (cuda with --target)")
    p.add_argument("--dtype", default="float32", help="the stack's dtype")
    p.add_argument("--serve-args", default="", help="more `ddtree serve` options, one string split as a shell "
                                                    "would; give it with = (--serve-args=--no-lanes)")
    p.add_argument("--out", type=Path, required=True, help="the JSON")
    args = p.parse_args()
    if (args.target is None) != (args.drafter is None):
        p.error("--target and --drafter go together")
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    counts = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if min(counts) < 1 or args.tokens < 1 or args.requests < 1:
        p.error("--clients, --tokens and --requests must be >= 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile = args.out.with_suffix(".gateway_profile.txt").resolve() if args.profile else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="step_host_") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        target, drafter = (args.target, args.drafter) if args.target else build_pair(root)
        extra = ([] if args.target else ["--no-fit-trees"]) + shlex.split(args.serve_args)
        stack = Stack(target, drafter, max(counts), args.budget, root / "serve.log", profile, args.device, args.dtype,
                      extra)
        try:
            model = stack.wait_ready()
            print(f"stack ready in {time.perf_counter() - started:.1f} s (pids {stack.pids})", flush=True)
            for mode in modes:
                warm = asyncio.run(run_clients(stack.url, model, mode, max(counts), 1, "warm-up", args))
                if failed := [s.error for s in warm if s.error]:
                    print(f"{mode} warm-up: {len(failed)} requests failed, e.g. {failed[0]}", flush=True)
                for clients in counts:
                    rows.append(level(stack, model, mode, clients, args))
                    r = rows[-1]
                    print(f"{mode} {clients} clients: {r['tokens']} tokens, {r['tokens_per_s']:.1f} tokens/s, "
                          f"{r['steps']} steps, step {r['step_ms']} ms, forwards {r['forward_ms']} ms, host "
                          f"{r['host_ms']} ms, errors {r['errors']} {r['error_samples'][:1]}", flush=True)
        finally:
            stack.stop()
        if stack.process.returncode != 0:
            print(f"ddtree serve exited with {stack.process.returncode}:\n{stack.log()}", file=sys.stderr)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "hardware": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                     "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "pair": ({"target": str(args.target), "drafter": str(args.drafter)} if args.target else
                 {"target": f"Qwen3, 1 layer, hidden {HIDDEN}, vocab {len(TOKENS)}, fp32, random weights",
                  "drafter": f"DFlash, 1 layer, hidden {HIDDEN}, block {BLOCK}, fp32, random weights"}),
        "serve_flags": stack.flags, "env": {"OMP_NUM_THREADS": "1"},
        "settings": {"clients": counts, "modes": modes, "tokens": args.tokens, "requests": args.requests,
                     "budget": args.budget, "prompt_words": args.prompt_words, "smoke": args.smoke,
                     "profile": args.profile, "serve_args": args.serve_args},
        "rows": rows,
    }
    if profile is not None and profile.exists():
        result["gateway_profile"] = str(profile)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
