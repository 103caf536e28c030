"""`ddtree serve`: drafter, verifier and gateway on this machine, as three processes (`ddtree draft`, `ddtree verify`,
`ddtree gateway`), their output prefixed [draft] [verify] [gateway]. With no model flags: the bundled demo pair.

Ctrl-C (or SIGTERM) stops the gateway first, so it ends its sessions while the model services are still up, then
the model services; each gets a grace period before it is killed. The model services listen on 127.0.0.1 only, on
ports `serve` picks free (their gRPC ports, which it hands to the gateway) or they pick (metrics, round lanes), so
several stacks share a host; only the HTTP API's port is fixed. Each stack's three processes share a secret of
their own (runtime/auth.py) that the model services require of every call but health checks.

A child that dies is started again, on the same port, after a backoff (1, 2, 4 ... 30 s; back to 1 s once it has
run a minute): while a model service is down the gateway decodes autoregressively (drafter down) or answers 503
(verifier down), and it takes the service back as soon as its health check says SERVING; while the gateway is down
the API refuses connections.

The children die with `serve`, however it ends (kill -9 included), so none keeps serving unsupervised or holds a
port: each runs in a process group of its own with a watchdog that kills the group once `serve` is gone (the
processes a service starts, such as its tensor-parallel ranks, are in that group too), and the kernel kills each
child itself when `serve` dies (Linux's parent-death signal). A child's group is killed too when the child exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import memory
from runtime.models import resolve_pair
from runtime.config import ServiceConfig, advanced_group
from draft_server.config import PREFIX_CACHE_GIB as DRAFT_PREFIX_CACHE_GIB, DraftServerConfig
from draft_server.dflash_config import DFlashConfig
from gateway.config import GatewayConfig
from verify_server.config import PREFIX_CACHE_GIB as VERIFY_PREFIX_CACHE_GIB, VerifyServerConfig

LOOPBACK = "127.0.0.1"
FIRST_PICKED_PORT = 20000  # free_ports picks from here up to the ephemeral range
PICK_ATTEMPTS = 64  # random ports tried, each taken or not, before the kernel picks one
STOP_TIMEOUT_S = 15.0  # per process, after SIGTERM, before SIGKILL (the services' own drain is shorter)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0  # before a dead child starts again: doubled per death, capped
STEADY_S = 60.0  # a child that ran this long before it died starts again after the first backoff
# Fields of the gateway's config that `serve` fills in itself; the others pass through as gateway flags.
CHOSEN = ("target", "verifier", "drafter", "host", "port", "auth_token")
# Runs as `python -I -S -c TETHER SERVE_PID FD COMMAND...` in each child between fork and its program (a Python of
# its own, stdlib only: preexec_fn is unsafe in `serve`, whose threads run). It asks the kernel for SIGKILL once
# `serve` dies (PR_SET_PDEATHSIG), and exits if `serve` died before that took hold. It forks the group's watchdog,
# which lets go of the child's output (`serve` reads it to its end) and reads FD, a pipe whose only write end
# `serve` holds: the read ends once `serve` is gone, however it ended, and the watchdog kills the group. Then it
# becomes COMMAND, keeping its pid.
TETHER = """
import os, signal, sys
PR_SET_PDEATHSIG = 1
serve, fd = int(sys.argv[1]), int(sys.argv[2])
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != serve:
    os._exit(1)
if os.fork() == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    while os.read(fd, 1):
        pass
    os.killpg(0, signal.SIGKILL)
    os._exit(0)
os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The options an operator sets first, the tuning knobs under "advanced". Each flag that goes on to a model
    service is its config's field (one definition, FlagConfig.add_flag); one left unset is not handed on, so the
    service's own default, or its DDTREE_DRAFT_* / DDTREE_VERIFY_* variable, holds."""
    p = sub.add_parser("serve", help="run drafter, verifier and gateway locally (three processes)")
    advanced = advanced_group(p)
    p.add_argument("model", nargs="?", help="target model directory or hub id, as --target")
    VerifyServerConfig.add_flag(p, "target", env=False)
    DraftServerConfig.add_flag(p, "drafter", env=False, help="DFlash drafter directory or hub id; 'none': decode "
                               "autoregressively (default: the demo drafter, with the demo target; with --target, "
                               "required)")
    ServiceConfig.add_flag(p, "device", env=False)
    ServiceConfig.add_flag(p, "dtype", env=False)
    VerifyServerConfig.add_flag(p, "tp", env=False)
    GatewayConfig.add_flag(p, "host", env=False, default=LOOPBACK)
    GatewayConfig.add_flag(p, "port", env=False)
    ServiceConfig.add_flag(p, "gpu_memory_utilization", env=False, default=None,
                           help="share of the GPU's memory this stack holds, split between the drafter and the "
                           "verifier on one device; each sizes its caches from what its part leaves and reserves them "
                           "at start-up (default 0.9; two stacks on one GPU: 0.45 each)")
    ServiceConfig.add_flag(p, "max_sessions", env=False, default=None,
                           help="sessions the verifier and the drafter each hold at once; the gateway runs no more "
                           "requests at once than they hold, so raise --max-running with it")
    ServiceConfig.add_flag(p, "max_session_tokens", env=False, default=None,
                           help="the longest session (prompt and answer) the verifier and the drafter each take "
                           "(default: the models' context; on a GPU the drafter's is what --max-sessions context "
                           "slots hold in its share)")
    VerifyServerConfig.add_flag(p, "deterministic", env=False, default=None)
    for config, name, what in ((DraftServerConfig, "port", "gRPC port of the drafter, for another client"),
                               (VerifyServerConfig, "port", "gRPC port of the verifier, for another client"),
                               (DraftServerConfig, "metrics_port", "Prometheus metrics port of the drafter, to scrape"),
                               (VerifyServerConfig, "metrics_port", "Prometheus metrics port of the verifier, to scrape")):
        service = "draft" if config is DraftServerConfig else "verify"
        config.add_flag(advanced, name, flag=f"--{service}-{name.replace('_', '-')}", env=False, default=0,
                        help=f"{what}: a fixed port against a clash between stacks on one host (0: a free one)")
    # a step's drafts go to the drafter in one call, as many as the verifier's batch: one bound for both
    VerifyServerConfig.add_flag(advanced, "max_batch", env=False, default=None,
                                help="sessions' steps verified in one forward, and their trees drafted in one: "
                                "tokens/s under load against a longer step (1: one at a time)")
    VerifyServerConfig.add_flag(advanced, "kv_cache_gib", env=False, default=None)
    VerifyServerConfig.add_flag(advanced, "fit_trees", env=False, default=None)
    ServiceConfig.add_flag(advanced, "eager", env=False, default=None)
    ServiceConfig.add_flag(advanced, "compile", env=False, default=None)
    GatewayConfig.add_arguments(p, exclude=CHOSEN, advanced=advanced)
    p.set_defaults(func=run)


@dataclass
class Child:
    name: str
    command: list[str]
    process: subprocess.Popen
    printer: threading.Thread
    started: float  # time.monotonic() of its start
    deaths: int = 0  # in a row, each within STEADY_S of its start: the backoff's exponent
    restart_at: float | None = None  # dead: when it starts again


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free on `host` now (all bound at once, so none is handed out twice), picked at random
    below the kernel's ephemeral range: a port bound to 0 (a service's metrics or lane port) or an outgoing
    connection's port comes from that range, so none of them can take a picked port before its service binds it,
    and two stacks starting at once seldom pick the same one. Where the range leaves no room below it, the kernel
    picks."""
    low = ephemeral_start()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            for _attempt in range(PICK_ATTEMPTS if low > FIRST_PICKED_PORT else 0):
                with contextlib.suppress(OSError):
                    sock.bind((host, FIRST_PICKED_PORT + secrets.randbelow(low - FIRST_PICKED_PORT)))
                    break
            else:
                sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's ip_local_port_range; IANA's 49152 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def backoff(deaths: int) -> float:
    """Seconds before a child that has died `deaths` times in a row starts again."""
    return min(FIRST_BACKOFF_S * 2 ** (deaths - 1), MAX_BACKOFF_S)


def stack_secret() -> dict[str, str]:
    """A new shared secret for this stack's three processes, as the env var each reads it from (not a flag: the
    process list would show it): only this gateway can call these model services, even from another user on the
    host."""
    token = secrets.token_urlsafe(32)
    return {config.env_var("auth_token"): token for config in (DraftServerConfig, VerifyServerConfig, GatewayConfig)}


def drafter_taps(drafter: str) -> list[int]:
    """The target layers a drafter directory's model taps (its config's target_layer_ids)."""
    return DFlashConfig.from_dict(json.loads((Path(drafter) / "config.json").read_text())).target_layer_ids


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The three command lines, in start order (the gateway last: it needs the others' addresses). The gRPC ports
    left 0 are picked here (the gateway must know them); the metrics and lane ports left 0 by the services."""
    if args.model is not None:
        if args.target is not None and args.target != args.model:
            raise SystemExit(f"ddtree serve: two targets, {args.model} and --target {args.target}")
        args.target = args.model
    if args.target is not None and args.drafter is None:  # the demo drafter fits the demo target only
        raise SystemExit("ddtree serve: --target needs --drafter: the target's DFlash drafter directory, or 'none' to "
                         "decode autoregressively")
    if args.max_sessions is not None and args.max_sessions < 1:
        raise SystemExit(f"ddtree serve: --max-sessions must be >= 1, got {args.max_sessions}")
    if args.max_session_tokens is not None and args.max_session_tokens < 2:
        raise SystemExit(f"ddtree serve: --max-session-tokens must be >= 2, got {args.max_session_tokens}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        # the verifier would refuse it at each start, and be restarted forever
        raise SystemExit(f"ddtree serve: --kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.deterministic and (args.tp > 1 or args.eager or args.compile):
        # the verifier would refuse them at each start, and be restarted forever
        raise SystemExit("ddtree serve: --deterministic runs the verifier on one GPU, uncompiled: not with --tp > 1, "
                         "--eager or --compile")
    target, drafter = resolve_pair(args.target, args.drafter)
    if (args.drafter or "").lower() == "none":
        drafter = None
    shares = memory_shares(args, target, drafter)
    ddtree = [sys.executable, "-m", "ddtree.cli"]
    model = ["--target", target, "--device", args.device, "--dtype", args.dtype, "--host", LOOPBACK,
             *given(args, "eager"), *given(args, "compile"), *given(args, "busy_poll_us"),
             *given(args, "max_sessions"), *given(args, "max_session_tokens")]
    draft_port, verify_port = free_ports(2)
    draft_port, verify_port = args.draft_port or draft_port, args.verify_port or verify_port
    cmds = {}
    if drafter is not None:
        # the gateway's default budget is the tree most requests ask for: drafted in warm-up, it costs them nothing
        cmds["draft"] = [*ddtree, "draft", *model, "--drafter", drafter, "--port", str(draft_port),
                         "--metrics-port", str(args.draft_metrics_port), *shares["draft"],
                         "--warm-up-budgets", str(args.budget), *given(args, "max_batch")]
    # the verifier captures, in warm-up, the rounds of the sessions this drafter brings (its taps, the gateway's budget)
    taps = ",".join(str(t) for t in drafter_taps(drafter)) if drafter is not None else ""
    asks = ["--drafter", f"{LOOPBACK}:{draft_port}"] if drafter is not None else []  # each step's trees
    cmds["verify"] = [*ddtree, "verify", *model, *asks, "--port", str(verify_port),
                      "--metrics-port", str(args.verify_metrics_port), "--tp", str(args.tp), *shares["verify"],
                      "--warm-up-taps", taps, "--warm-up-nodes", str(args.budget),
                      *given(args, "max_batch"), *given(args, "max_step_tokens"), *given(args, "deterministic"),
                      *given(args, "kv_cache_gib"), *given(args, "fit_trees")]
    addresses = {"verifier": f"{LOOPBACK}:{verify_port}",
                 "drafter": f"{LOOPBACK}:{draft_port}" if drafter is not None else "none"}
    try:  # the gateway would refuse them at each start, and be restarted forever
        GatewayConfig.from_args(args, target=target, host=args.host, port=args.port, auth_token=None, **addresses)
    except ValueError as exc:
        raise SystemExit(f"ddtree serve: {exc}") from None
    gateway = [*ddtree, "gateway", "--target", target, "--host", args.host, "--port", str(args.port),
               "--verifier", addresses["verifier"], "--drafter", addresses["drafter"]]
    for name in (f.name for f in dataclasses.fields(GatewayConfig) if f.name not in CHOSEN):
        value, flag = getattr(args, name), name.replace("_", "-")
        if isinstance(value, bool):  # a --flag / --no-flag switch
            gateway.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None and name != "api_key":  # the key goes by env (run), out of the process list
            gateway += [f"--{flag}", str(value)]
    cmds["gateway"] = gateway
    return cmds


def given(args: argparse.Namespace, name: str, flag: str | None = None) -> list[str]:
    """A serve flag handed on to a model service as its `flag` (by default the same), only where it was given."""
    value, flag = getattr(args, name), flag or "--" + name.replace("_", "-")
    if value is None:
        return []
    if isinstance(value, bool):  # a --flag / --no-flag switch
        return [flag if value else "--no-" + flag.removeprefix("--")]
    return [flag, str(value)]


def memory_shares(args: argparse.Namespace, target: str, drafter: str | None) -> dict[str, list[str]]:
    """Each model service's --gpu-memory-utilization: on a CUDA device, the stack's share split between the drafter
    and the verifier by what each holds (runtime/memory.py's drafter_share, from the models' configurations); no
    flag elsewhere (a share given there is refused, as the services would refuse it at every start)."""
    utilization = args.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        raise SystemExit(f"ddtree serve: --gpu-memory-utilization must be in (0, 1], got {utilization}")
    device = ServiceConfig(device=args.device).torch_device()
    if device.type != "cuda":
        if utilization is not None:
            raise SystemExit(f"ddtree serve: --gpu-memory-utilization is a CUDA device's share, not {device}'s")
        return {"draft": [], "verify": []}
    utilization = utilization if utilization is not None else memory.DEFAULT_UTILIZATION
    dtype = ServiceConfig(device=args.device, dtype=args.dtype).torch_dtype()
    drafter_part = 0.0
    if drafter is not None:
        prefixes = (int(VERIFY_PREFIX_CACHE_GIB[0] * memory.GIB), int(DRAFT_PREFIX_CACHE_GIB[0] * memory.GIB))
        sessions = args.max_sessions or ServiceConfig.max_sessions
        drafter_part = memory.drafter_share(device_total(device), utilization, target, drafter, dtype, sessions,
                                            prefixes)
    return {"draft": ["--gpu-memory-utilization", f"{drafter_part:.4f}"],
            "verify": ["--gpu-memory-utilization", f"{utilization - drafter_part:.4f}"]}


def device_total(device: torch.device) -> int:
    """A CUDA device's memory, read in a process of its own: `serve` itself keeps no CUDA context on the device."""
    probe = "import sys, torch; print(torch.cuda.get_device_properties(sys.argv[1]).total_memory)"
    result = subprocess.run([sys.executable, "-c", probe, str(device)], capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"ddtree serve: cannot read {device}'s memory: {result.stderr.strip()[-500:]}")
    return int(result.stdout)


def run(args: argparse.Namespace) -> int:
    cmds = commands(args)
    # A gateway that cannot bind the API's port would be started again forever: refuse it now.
    check_port_free(args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # PYTHONUNBUFFERED: the prefixed lines arrive as they are written. OMP_WAIT_POLICY (unless set): the services
    # take turns every round, and on CPU an idle one's OpenMP threads would spin on the cores the busy one needs.
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1", **stack_secret(),
           **({GatewayConfig.env_var("api_key"): args.api_key} if args.api_key else {})}
    # The children's watchdogs read `alive`; `serve` holds the write end, never written, until it ends.
    alive, _ = os.pipe()
    children: list[Child] = []
    try:
        for name, cmd in cmds.items():
            children.append(_start(name, cmd, env, alive))
        print(f"[serve] OpenAI API on http://{args.host}:{args.port}/v1 (GET /health says when it is ready)",
              flush=True)
        return _supervise(children, stop, env, alive)
    finally:
        # the gateway's own drain lasts its shutdown grace: it is given that on top
        _stop([c for c in children if c.name == "gateway"], STOP_TIMEOUT_S + args.shutdown_grace)
        _stop([c for c in children if c.name != "gateway"], STOP_TIMEOUT_S)


def check_port_free(host: str, port: int) -> None:
    """Exits unless `host`:`port` can be bound now, as the gateway's server binds it (SO_REUSEADDR)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise SystemExit(f"ddtree serve: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _start(name: str, cmd: list[str], env: dict[str, str], alive: int) -> Child:
    # A session of its own: Ctrl-C reaches only `serve`, which then stops the children in order; the session is
    # also the group the watchdog kills. The parent-death signal fires when the thread that forked the child ends,
    # so children are started from the main thread only, which lasts as long as `serve`.
    assert threading.current_thread() is threading.main_thread()
    tethered = [sys.executable, "-I", "-S", "-c", TETHER, str(os.getpid()), str(alive), *cmd]
    process = subprocess.Popen(tethered, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, text=True, errors="replace", start_new_session=True, pass_fds=(alive,))
    printer = threading.Thread(target=_prefix_lines, args=(name, process), daemon=True)
    printer.start()
    print(f"[serve] {name} started (pid {process.pid})", flush=True)
    return Child(name, cmd, process, printer, time.monotonic())


def _prefix_lines(name: str, process: subprocess.Popen) -> None:
    for line in process.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def _exit_code(child: Child) -> int | None:
    """The child's exit status, or None while it runs. Once it has exited, its group (its watchdog, and any process
    of its own left) is killed before it is reaped: until then its pid, the group's id, cannot be anyone else's."""
    if child.process.returncode is None:
        if os.waitid(os.P_PID, child.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.process.pid, signal.SIGKILL)
    return child.process.poll()


def _supervise(children: list[Child], stop: threading.Event, env: dict[str, str], alive: int) -> int:
    """Until a signal (-> 0), starts the children that die again; but a model service whose share of the device
    does not hold it would not fit at any start (-> 1, the stack stops)."""
    while not stop.wait(0.5):
        now = time.monotonic()
        for i, child in enumerate(children):
            code = _exit_code(child)
            if code is None:
                continue
            if code == memory.MEMORY_MISFIT_EXIT:
                child.printer.join()  # its reason first
                print(f"[serve] {child.name} does not fit its share of the device (above); stopping", flush=True)
                return 1
            if child.restart_at is None:
                child.printer.join()  # its last lines first
                child.deaths = 1 if now - child.started >= STEADY_S else child.deaths + 1
                child.restart_at = now + backoff(child.deaths)
                print(f"[serve] {child.name} exited with code {code}; starting it again in "
                      f"{backoff(child.deaths):.0f} s", flush=True)
            elif now >= child.restart_at:
                children[i] = _start(child.name, child.command, env, alive)
                children[i].deaths = child.deaths


def _stop(children: list[Child], timeout: float) -> None:
    for child in children:
        if _exit_code(child) is None:
            child.process.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        while _exit_code(child) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.process.returncode is None:
            print(f"[serve] {child.name} did not stop in {timeout:.0f} s; killing it", flush=True)
            os.killpg(child.process.pid, signal.SIGKILL)  # its group with it: not reaped yet, the id is still its
            child.process.wait()
        child.printer.join()
