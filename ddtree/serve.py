"""`ddtree serve`: drafter, verifier and gateway on this machine, as three processes (`ddtree draft`, `ddtree verify`,
`ddtree gateway`), their output prefixed [draft] [verify] [gateway]. With no model flags: the bundled demo pair.

Ctrl-C (or SIGTERM) stops the gateway first, so it ends its sessions while the model services are still up, then
the model services; each gets a grace period before it is killed. The gRPC services listen on 127.0.0.1 only.
If the drafter dies the others carry on (the gateway decodes autoregressively); if the verifier or the gateway
dies, everything stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from runtime.models import resolve_pair
from runtime.config import DTYPE_NAMES
from draft_server.dflash_config import DFlashConfig
from gateway.config import GatewayConfig

LOOPBACK = "127.0.0.1"
STOP_TIMEOUT_S = 15.0  # per process, after SIGTERM, before SIGKILL (the services' own drain is shorter)
# Fields of the gateway's config that `serve` fills in itself; the others pass through as gateway flags.
CHOSEN = ("target", "verifier", "drafter", "host", "port")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run drafter, verifier and gateway locally (three processes)")
    p.add_argument("--target", help="target model directory (default: the bundled demo target)")
    p.add_argument("--drafter", help="DFlash drafter directory; 'none': decode autoregressively (default: the demo "
                   "drafter, with the demo target; with --target, required)")
    p.add_argument("--device", default="auto", help="torch device of both model services: cpu, cuda, cuda:N, auto")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES)
    p.add_argument("--host", default=LOOPBACK, help="interface of the HTTP API")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    p.add_argument("--draft-port", type=int, default=50061, help="gRPC port of the drafter")
    p.add_argument("--verify-port", type=int, default=50062, help="gRPC port of the verifier")
    p.add_argument("--draft-metrics-port", type=int, default=9461, help="Prometheus metrics port of the drafter")
    p.add_argument("--verify-metrics-port", type=int, default=9462, help="Prometheus metrics port of the verifier")
    p.add_argument("--tp", type=int, default=1, help="shard the target over N ranks (cuda:0..N-1, or CPU processes)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="the verifier verifies at most N sessions' waiting rounds in one forward (1: one at a time)")
    p.add_argument("--draft-max-batch", type=int, default=1,
                   help="the drafter drafts at most N sessions' waiting blocks in one forward (1: one at a time)")
    p.add_argument("--eager", action="store_true", help="model services without static buffers or CUDA graphs")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model services' steps (default: on with a CUDA device)")
    GatewayConfig.add_arguments(p, exclude=CHOSEN)
    p.set_defaults(func=run)


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    printer: threading.Thread


def drafter_taps(drafter: str) -> list[int]:
    """The target layers a drafter directory's model taps (its config's target_layer_ids)."""
    return DFlashConfig.from_dict(json.loads((Path(drafter) / "config.json").read_text())).target_layer_ids


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The three command lines, in start order (the gateway last: it needs the others' addresses)."""
    if args.target is not None and args.drafter is None:  # the demo drafter fits the demo target only
        raise SystemExit("ddtree serve: --target needs --drafter: the target's DFlash drafter directory, or 'none' to "
                         "decode autoregressively")
    target, drafter = resolve_pair(args.target, args.drafter)
    if (args.drafter or "").lower() == "none":
        drafter = None
    ddtree = [sys.executable, "-m", "ddtree.cli"]
    model = ["--target", target, "--device", args.device, "--dtype", args.dtype, "--host", LOOPBACK,
             *(["--eager"] if args.eager else []),
             *([] if args.compile is None else ["--compile" if args.compile else "--no-compile"]),
             *([] if args.busy_poll_us is None else ["--busy-poll-us", str(args.busy_poll_us)])]
    cmds = {}
    if drafter is not None:
        # the gateway's default budget is the tree most requests ask for: drafted in warm-up, it costs them nothing
        cmds["draft"] = [*ddtree, "draft", *model, "--drafter", drafter, "--port", str(args.draft_port),
                         "--metrics-port", str(args.draft_metrics_port), "--warm-up-budgets", str(args.budget),
                         "--max-batch", str(args.draft_max_batch)]
    # the verifier captures, in warm-up, the rounds of the sessions this drafter brings (its taps, the gateway's budget)
    taps = ",".join(str(t) for t in drafter_taps(drafter)) if drafter is not None else ""
    cmds["verify"] = [*ddtree, "verify", *model, "--port", str(args.verify_port),
                      "--metrics-port", str(args.verify_metrics_port), "--tp", str(args.tp),
                      "--max-batch", str(args.max_batch), "--warm-up-taps", taps, "--warm-up-nodes", str(args.budget)]
    gateway = [*ddtree, "gateway", "--target", target, "--host", args.host, "--port", str(args.port),
               "--verifier", f"{LOOPBACK}:{args.verify_port}",
               "--drafter", f"{LOOPBACK}:{args.draft_port}" if drafter is not None else "none"]
    for name in (f.name for f in dataclasses.fields(GatewayConfig) if f.name not in CHOSEN):
        value, flag = getattr(args, name), name.replace("_", "-")
        if isinstance(value, bool):  # a --flag / --no-flag switch
            gateway.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            gateway += [f"--{flag}", str(value)]
    cmds["gateway"] = gateway
    return cmds


def run(args: argparse.Namespace) -> int:
    cmds = commands(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # PYTHONUNBUFFERED: the prefixed lines arrive as they are written. OMP_WAIT_POLICY (unless set): the services
    # take turns every round, and on CPU an idle one's OpenMP threads would spin on the cores the busy one needs.
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1"}
    children: list[Child] = []
    try:
        for name, cmd in cmds.items():
            children.append(_start(name, cmd, env))
        print(f"[serve] OpenAI API on http://{args.host}:{args.port}/v1 (GET /health says when it is ready)",
              flush=True)
        return _supervise(children, stop)
    finally:
        for group in (["gateway"], ["draft", "verify"]):
            _stop([c for c in children if c.name in group])


def _start(name: str, cmd: list[str], env: dict[str, str]) -> Child:
    # A session of its own: Ctrl-C reaches only `serve`, which then stops the children in order.
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, text=True, errors="replace", start_new_session=True)
    printer = threading.Thread(target=_prefix_lines, args=(name, process), daemon=True)
    printer.start()
    return Child(name, process, printer)


def _prefix_lines(name: str, process: subprocess.Popen) -> None:
    for line in process.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def _supervise(children: list[Child], stop: threading.Event) -> int:
    """Waits for a signal (-> 0) or for the verifier or the gateway to exit (-> 1)."""
    reported: set[str] = set()
    while not stop.wait(0.5):
        for child in children:
            code = child.process.poll()
            if code is None or child.name in reported:
                continue
            if child.name != "draft":
                print(f"[serve] {child.name} exited with code {code}; stopping", flush=True)
                return 1
            print(f"[serve] draft exited with code {code}; the gateway decodes autoregressively", flush=True)
            reported.add(child.name)
    return 0


def _stop(children: list[Child]) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    for child in children:
        try:
            child.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"[serve] {child.name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it", flush=True)
            child.process.kill()
            child.process.wait()
        child.printer.join()
