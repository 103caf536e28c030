"""Where a round's time goes between the services: each one-way hop, each server's job and the GPU inside it.

Every process on one host reads the same monotonic clock (time.perf_counter is CLOCK_MONOTONIC on Linux), so a
server that stamps when a call reaches its engine and when the answer leaves lets the caller split a call into
the way in, the server's job (its GPU phases and its host work) and the way back. (What a hop costs apart from
the services: bench/rpc_echo.py.)

    python bench/rpc_hops.py serve verify ARGS...     # `ddtree verify ARGS...` with the stamps (likewise draft)
    python bench/rpc_hops.py serve --profile-jobs FILE verify ARGS...   # and cProfile of the round calls' jobs
    python bench/rpc_hops.py serve --stages verify ARGS...   # and the wall time of each stage of those jobs
    python bench/rpc_hops.py serve --trace FILE verify ARGS...   # and a torch.profiler trace of TRACE_JOBS of them
    python bench/rpc_hops.py probe --drafter HOST:PORT --verifier HOST:PORT [--budget 32 --num-prompts 24
                                   --max-new-tokens 96 --transports lane,grpc --busy-poll-us 0 --keep-warm-us 0
                                   --profile FILE --out FILE]

The probe runs the gateway's round loop (gateway/rounds.py over gateway/grpc_clients.py, no HTTP) against the
stamped services, with the round calls over the services' round lanes and over gRPC streams one after the other,
and reports per-round medians in microseconds. Linux only (the shared clock).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runtime import event_loop
from ddtree.bench import DEFAULT_PROMPTS
from runtime.event_loop import busy_poll_seconds

# ---- stamped services ----------------------------------------------------------------------------------------


# The stages of the round calls' jobs that `serve --stages` times, as (module, attribute, stage name): what the
# servicers call between parsing a request and building its answer.
STAGES = (
    ("protos.tensors", "tensor_from_pb", "parse"),  # the drafter's features
    ("draft_server.drafter", "DraftEngine.draft", "engine"),  # queues append, block and tree; no sync
    ("protos.tensors", "draft_to_pb", "to pb"),  # with the draft's one sync: the tree's copy to the host
    ("runtime.timing", "StepTimer.__init__", "timer"),  # both services: the step's CUDA events
    ("draft_server.draft_graphs", "StaticDrafter.draft", "inputs and graphs"),  # inside "engine": append + block
    ("draft_server.draft_graphs", "StaticDrafter.tree", "tree"),  # inside "engine": the tree's graph and copies
    ("kernels.cuda_graphs", "GraphPool.run", "replays"),  # both services: every graph launch, summed
    ("protos.tensors", "tree_from_pb", "parse"),
    ("verify_server.server", "check_tree", "check"),
    ("verify_server.verify", "VerifyEngine._launch", "launch"),  # queues the captured round
    ("verify_server.fused_runner", "FusedRunner._prepare_batch", "inputs"),  # inside "launch": write + upload
    # inside "launch": the outcome's and the path's features' stores to the host, in one launch
    ("verify_server.queued_rounds", "copy_together", "readbacks"),
    ("verify_server.verify", "VerifyEngine._kept_rows", "features"),  # inside "launch": where the path's rows go
    ("verify_server.verify", "VerifyEngine.collect", "collect"),  # the round's one sync, then the commit
    ("protos.tensors", "step_to_pb", "to pb"),
)


# `serve --trace`: the round jobs traced (CPU ops, CUDA runtime calls and kernels on one clock), past the probe's
# warm-up pass (~500 rounds of 8 prompts x 64 tokens at Qwen3-8B shapes with random weights, ~1 token a round)
TRACE_FIRST_JOB, TRACE_JOBS = 600, 20


def _time_stages(stages: dict[str, float], traced: Callable[[], bool]) -> None:
    """Wraps every STAGES function so that its calls add their wall time to stages[name], and show in a trace as
    ranges of that name while traced()."""
    import importlib

    from torch.profiler import record_function

    def timed(fn, name):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                if traced():
                    with record_function(f"stage: {name}"):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                stages[name] = stages.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    for module_name, attribute, name in STAGES:
        owner = importlib.import_module(module_name)
        *path, leaf = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, timed(getattr(owner, leaf), name))


def serve(argv: list[str]) -> int:
    """`ddtree <argv>` with every engine call's arrival and answer stamped into its response's timings. With
    `--stages` first, the round calls' jobs also report the wall time of each of their STAGES. With
    `--profile-jobs FILE` first, the round calls' jobs (Draft, Verify, Decode) also run under cProfile, whose
    table (by own time, then by cumulative time) goes to FILE when the service stops. With `--trace FILE` first,
    round jobs TRACE_FIRST_JOB.. (TRACE_JOBS of them) run under torch.profiler, whose Chrome trace goes to FILE
    when the service stops (with --stages too, the stages show as ranges)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from runtime import service
    from ddtree.cli import main

    trace_to, jobs, tracer = None, 0, None
    if argv[:1] == ["--trace"]:
        trace_to, argv = Path(argv[1]), argv[2:]
        tracer = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    stages: dict[str, float] | None = None
    if argv[:1] == ["--stages"]:
        stages, argv = {}, argv[1:]
        _time_stages(stages, lambda: TRACE_FIRST_JOB <= jobs < TRACE_FIRST_JOB + TRACE_JOBS and tracer is not None)
    profile_to = None
    if argv[:1] == ["--profile-jobs"]:
        profile_to, argv = Path(argv[1]), argv[2:]
    profiler = cProfile.Profile()
    answer, execute = service.EngineHost.answer, service.EngineHost.execute  # noqa: SLF001 - stamped here

    async def stamped_execute(self, rpc, job):
        """The engine's job (a call's, or a Batch run's of several calls) with its start and end stamped into each
        response it makes."""
        round_job = rpc in service.ROUND_RPCS
        profiled = profile_to is not None and round_job

        def timed_job(engine):
            nonlocal jobs
            traced = tracer is not None and round_job and TRACE_FIRST_JOB <= jobs < TRACE_FIRST_JOB + TRACE_JOBS
            if traced and jobs == TRACE_FIRST_JOB:
                tracer.start()
            if stages is not None:
                stages.clear()
            started = time.perf_counter()
            if profiled:
                profiler.enable()
            try:
                if traced:
                    with record_function(f"{rpc} job"):
                        outcome = job(engine)
                else:
                    outcome = job(engine)
            finally:
                if profiled:
                    profiler.disable()
                if round_job:
                    jobs += 1
                    if traced and jobs == TRACE_FIRST_JOB + TRACE_JOBS:
                        tracer.stop()
            ended = time.perf_counter()
            for response in outcome if isinstance(outcome, list) else [outcome]:  # a Batch run: one per call
                if hasattr(response, "timings"):  # not an exception
                    detail = response.timings.detail
                    detail[f"{rpc}.job_start"], detail[f"{rpc}.job_end"] = started, ended
                    for name, seconds in (stages or {}).items():
                        detail[f"{rpc}.stage.{name}"] = seconds
            return outcome

        return await execute(self, rpc, timed_job)

    async def stamped_answer(self, rpc, context, forward, respond):
        """A call from its arrival at the servicer to its answer's leaving, stamped into the response."""
        arrived = time.perf_counter()
        response = await answer(self, rpc, context, forward, respond)
        detail = response.timings.detail
        detail[f"{rpc}.arrived"], detail[f"{rpc}.answered"] = arrived, time.perf_counter()
        return response

    service.EngineHost.answer, service.EngineHost.execute = stamped_answer, stamped_execute  # noqa: SLF001
    try:
        return main(argv)
    finally:
        if trace_to is not None and jobs >= TRACE_FIRST_JOB + TRACE_JOBS:
            tracer.export_chrome_trace(str(trace_to))
        if profile_to is not None:
            with profile_to.open("w") as out:
                stats = pstats.Stats(profiler, stream=out)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(40)


# ---- the probe -----------------------------------------------------------------------------------------------


def hops(t: dict[str, float]) -> dict[str, float]:
    """One round's timings (client send/receive stamps and the servers' stamps) -> its parts in seconds."""
    return {
        "draft in": t["Draft.arrived"] - t["draft.sent"],
        "draft job": t["Draft.job_end"] - t["Draft.job_start"],
        "draft gpu": t["draft_s"] + t["tree_s"],
        "draft gpu: forward": t["draft_s"],  # append + block
        "draft gpu: tree": t["tree_s"],  # the tree's graph, and its host copy for the service
        "draft back": t["draft.received"] - t["Draft.answered"],
        "gateway": t["verify.sent"] - t["draft.received"],
        "verify in": t["Verify.arrived"] - t["verify.sent"],
        "verify job": t["Verify.job_end"] - t["Verify.job_start"],
        "verify gpu": t["verify_s"] + t.get("walk_s", 0.0),
        "verify back": t["verify.received"] - t["Verify.answered"],
        "servers outside the job": sum(t[f"{r}.answered"] - t[f"{r}.arrived"] - t[f"{r}.job_end"] + t[f"{r}.job_start"]
                                       for r in ("Draft", "Verify")),
        "round": t["round_s"],
        **{f"{key.split('.')[0].lower()} job: {key.split('.stage.')[1]}": t[key]
           for key in t if ".stage." in key and key.split(".")[0] in ("Draft", "Verify")},
    }


async def probe(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from ddtree.bench import load_prompts
    from runtime.models import resolve_pair
    from protos.types import SamplingParams
    from gateway.grpc_clients import GrpcDrafter, GrpcVerifier
    from gateway.rounds import Speculation, run_rounds

    class Drafter(GrpcDrafter):
        async def draft(self, *a):
            sent = time.perf_counter()
            tree, timings = await super().draft(*a)
            return tree, {**timings, "draft.sent": sent, "draft.received": time.perf_counter()}

    class Verifier(GrpcVerifier):
        async def verify(self, *a):
            sent = time.perf_counter()
            step = await super().verify(*a)
            step.timings.update({"verify.sent": sent, "verify.received": time.perf_counter()})
            return step

    target, _ = resolve_pair(args.target, None)
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(target, local_files_only=True), args.num_prompts)
    spec = Speculation("ddtree", args.budget)
    transports = args.transports.split(",")
    profiler = cProfile.Profile()  # the client's side of the first transport's timed pass, with --profile
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    for timed_pass in (False, True):  # the first pass captures every graph the second one meets
        for transport in transports:  # one after the other over the same prompts, on the same warm services
            drafter = Drafter(args.drafter, lanes=transport == "lane")
            verifier = Verifier(args.verifier, lanes=transport == "lane")
            if event_loop.keep_warm(args.keep_warm_us, lambda: (drafter.rehearse(), verifier.rehearse()), "probe"):
                drafter.rehearsing = verifier.rehearsing = True
            await drafter.info()
            eos = (await verifier.info()).eos_token_ids
            profiled = timed_pass and args.profile and transport == transports[0]
            if profiled:
                profiler.enable()
            for prompt in prompts:
                loop = run_rounds(verifier, drafter, prompt, SamplingParams(), spec, args.max_new_tokens, eos)
                async for rnd in loop:
                    if timed_pass and rnd.index and "draft.sent" in rnd.timings:
                        rows[transport].append(hops(rnd.timings))
            if profiled:
                profiler.disable()
            await drafter.close()
            await verifier.close()
    if args.profile:
        with open(args.profile, "w") as out:
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(50)
    result = {}
    for transport, timed in rows.items():
        medians = {k: round(1e6 * statistics.median(r[k] for r in timed), 1) for k in timed[0]}
        p90 = {k: round(1e6 * statistics.quantiles([r[k] for r in timed], n=10)[-1], 1) for k in timed[0]}
        result[transport] = {"rounds": len(timed), "median_us": medians, "p90_us": p90}
    print(f"{'median us':24s}" + "".join(f"{t:>10s}" for t in transports))
    for name in result[transports[0]]["median_us"]:
        print(f"{name:24s}" + "".join(f"{result[t]['median_us'][name]:10.1f}" for t in transports))
    return result


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        return serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("probe",))
    p.add_argument("--drafter", default="127.0.0.1:50061")
    p.add_argument("--verifier", default="127.0.0.1:50062")
    p.add_argument("--target", help="its tokenizer (default: the bundled demo target)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--transports", default="lane,grpc",
                   help="probe: the round calls over the services' round lanes and/or gRPC streams, side by side")
    p.add_argument("--profile", help="probe: cProfile of the round loop's own host work (first transport) to FILE")
    p.add_argument("--busy-poll-us", type=int, default=0,
                   help="probe: its event loop polls this long after I/O, as the gateway's (runtime/event_loop.py)")
    p.add_argument("--keep-warm-us", type=int, default=0,
                   help="probe: while polling, rehearse its last round calls' host steps this often, as a gateway's")
    p.add_argument("--out")
    args = p.parse_args()
    result = event_loop.run(probe(args), busy_poll_seconds(args.busy_poll_us))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
