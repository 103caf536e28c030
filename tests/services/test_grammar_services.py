"""Constrained trees through the real drafter and verifier on loopback (the demo pair): the gateway's drafter client
sends the grammar at the drafter's StartSession, the verifier each draft's committed tokens in its steps'
DraftBatch calls, and the output equals the in-process round loop's, drafted trees and no drafter failure on the
way. A grammar the drafter cannot compile, and committed tokens that do not continue the output, are
INVALID_ARGUMENT; the session drafts on afterwards."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from ddtree.local import load_local
from gateway.grpc_verifier import GrpcVerifier
from gateway.engine import Engine
from gateway.rounds import Speculation, run_rounds
from protos.types import DraftAsk, SamplingParams
from runtime.client import BackendError
from runtime.drafter_client import GrpcDrafter
from runtime.grammar import json_schema_grammar
from runtime.models import read_eos_ids, resolve_pair
from tests.services import (
    DRAFTER_SERVICE, VERIFIER_SERVICE, PacedVerifier, Service, free_ports, launch, one, wait_serving,
)

SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["blue", "green", "grey"]}, "clear": {"type": "boolean"}},
          "required": ["sky", "clear"]}
QUESTIONS = ["Answer in JSON: what colour is the sky, and is it clear?", "Is the sky clear today? Reply in JSON."]
MAX_NEW = 40
ANSWER_S = 0.1  # a step's answer held back in InFlight: longer than a busy CI machine's pauses of the event loop


@dataclass
class Stack:
    drafter: Service
    verifier: Service
    prompts: list[list[int]]
    eos: list[int]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    target, drafter = resolve_pair(None, None)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    logs = tmp_path_factory.mktemp("grammar-services")
    ports = free_ports(4)
    procs = (
        launch(DRAFTER_SERVICE, ["draft_server.server", "--drafter", str(drafter), "--target", str(target),
                                 "--dtype", "float32", "--warm-up-budgets", "16"], (ports[0], ports[1]), logs),
        launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(target), "--dtype", "float32",
                                  "--drafter", f"127.0.0.1:{ports[0]}"], (ports[2], ports[3]), logs),
    )
    try:
        wait_serving(*procs)
        yield Stack(*procs, prompts, read_eos_ids(target))
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def in_process(stack) -> list[list[int]]:
    """Each prompt's output through the in-process round loop: what the services must give."""
    target, drafter = resolve_pair(None, None)
    verifier, local = load_local(str(target), str(drafter), "cpu", torch.float32)
    return [asyncio.run(_generate(verifier, local, prompt, stack.eos, [], [])) for prompt in stack.prompts]


async def _generate(verifier, drafter, prompt: list[int], eos: list[int], fallbacks: list, trees: list) -> list[int]:
    """The request's tokens; its rounds' tree sizes are added to `trees`."""
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    loop = run_rounds(verifier, drafter, prompt, params, Speculation("ddtree", 16), MAX_NEW, eos, fallbacks.append)
    tokens = []
    async for rnd in loop:
        tokens += rnd.tokens
        trees.append(rnd.tree_size)
    return tokens


class InFlight:
    """The verifier's client, recording each Step call's sessions with the Step calls in flight beside it, and the
    sessions whose prompt brings a grammar (a recorder around the real client: every call goes through). Each answer
    is held back ANSWER_S, as a step on a real model takes that long: the gateway's next step then leaves while it
    is out, whatever the speed of this machine."""

    def __init__(self, client: GrpcVerifier) -> None:
        self.client = client
        self.remote = client.remote
        self.out: list[list[str]] = []  # the sessions of each Step call in flight
        self.sent: list[tuple[list[str], list[list[str]]]] = []  # each call's sessions, and those of the calls out
        self.grammars: set[str] = set()

    async def step(self, steps):
        sessions = [step.session_id for step in steps]
        self.grammars |= {step.session_id for step in steps
                          if step.prompt is not None and step.prompt.start and step.prompt.start.params.grammar}
        self.sent.append((sessions, [list(out) for out in self.out]))
        self.out.append(sessions)
        try:
            outcomes = await self.client.step(steps)
            await asyncio.sleep(ANSWER_S)
            return outcomes
        finally:
            self.out.remove(sessions)

    async def end_session(self, session_id: str) -> None:
        await self.client.end_session(session_id)


def test_a_grammar_request_leaves_the_others_steps_back_to_back(stack) -> None:
    """AR steps go to the verifier before the step before them is answered; a request with a grammar among them
    goes in those whose step before was answered (its masks follow from its committed tokens), so the others'
    steps still go back to back. Each output is the in-process loop's (the constrained decode, the free one)."""
    target, drafter = resolve_pair(None, None)
    local, _ = load_local(str(target), str(drafter), "cpu", torch.float32)
    grammar = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    asks = [(stack.prompts[0], grammar), (stack.prompts[1], SamplingParams()), (stack.prompts[0], SamplingParams())]

    async def generate(verifier) -> list[list[int]]:
        engine = Engine(verifier, None)
        spec = Speculation("ar")

        async def one(prompt: list[int], params: SamplingParams) -> list[int]:
            return [t for r in [r async for r in engine.generate(prompt, params, spec, MAX_NEW, stack.eos)]
                    for t in r.tokens]

        try:
            return list(await asyncio.gather(*(one(prompt, params) for prompt, params in asks)))
        finally:
            await engine.stop()

    async def remote() -> tuple[list[list[int]], InFlight]:
        async with GrpcVerifier(stack.verifier.address) as client:
            recorder = InFlight(client)
            return await generate(recorder), recorder

    outputs, recorder = asyncio.run(remote())
    assert outputs == asyncio.run(generate(local))
    (g,) = recorder.grammars
    behind = [(sessions, out) for sessions, out in recorder.sent if out]
    assert behind, "no step went before the one before it was answered"
    assert any(g in sessions for sessions, _ in behind)  # the grammar request steps behind others too
    assert all(not (g in sessions and any(g in o for o in out)) for sessions, out in recorder.sent)


def test_grammar_requests_through_the_services(stack, in_process) -> None:
    async def scenario() -> tuple[list[list[int]], list, list[int]]:
        fallbacks: list = []
        trees: list[int] = []
        async with (GrpcVerifier(stack.verifier.address) as verifier,
                    GrpcDrafter(stack.drafter.address) as drafter):
            await drafter.info()
            # (each generation's decode waits for its prompt's features in the drafter: a tree is due whatever the load)
            outputs = await asyncio.gather(*(_generate(PacedVerifier(verifier, stack.drafter), drafter, p, stack.eos,
                                                       fallbacks, trees) for p in stack.prompts))
        return outputs, fallbacks, trees

    outputs, fallbacks, trees = asyncio.run(scenario())
    assert fallbacks == []  # the drafter took every draft's committed tokens
    assert any(trees), "no step verified a tree"
    assert outputs == in_process
    assert stack.drafter.metric("ddtree_draft_active_sessions") == 0


def test_bad_grammars_and_committed_tokens_are_invalid_argument(stack) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_pair(None, None)[0], local_files_only=True)
    opening, key = (tokenizer.encode(text, add_special_tokens=False) for text in ("{", '"sky": "'))

    async def status(call) -> tuple[grpc.StatusCode, str]:
        try:
            await call
        except BackendError as exc:
            return exc.code, exc.details
        return grpc.StatusCode.OK, ""

    async def scenario() -> dict[str, tuple[grpc.StatusCode, str]]:
        async with GrpcDrafter(stack.drafter.address) as drafter:
            info = await drafter.info()
            features = torch.zeros(8 + 1 + 8, info.feature_dim)
            session = uuid.uuid4().hex
            out = {
                "not JSON": await status(drafter.start_session(uuid.uuid4().hex, 64, "{json_object")),
                "bad schema": await status(drafter.start_session(uuid.uuid4().hex, 64,
                                                                 json_schema_grammar({"type": "colour"}))),
            }
            await drafter.start_session(session, 64, json_schema_grammar(SCHEMA))

            def draft(root: int, position: int, committed: list[int]):  # the context reaches the root each time
                ask = DraftAsk(session, [features[: position - 8]], root, position, 8, None, committed)
                return status(one(drafter.draft([ask])))

            n = len(key)
            out["first"] = await status(one(drafter.draft([DraftAsk(session, [features[:8]], opening[-1], 8, 8, None,
                                                                    opening)])))
            out["no root"] = await draft(key[-1], 8 + n, key[:-1])
            out["gap"] = await draft(key[-1], 9 + n, key)
            out["refused"] = await draft(opening[0], 8 + n, key[:-1] + opening)
            out["next"] = await draft(key[-1], 8 + n, key)
            await drafter.end_session(session)
            return out

    out = asyncio.run(scenario())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert out["not JSON"][0] == invalid and "must be JSON" in out["not JSON"][1]
    assert out["bad schema"][0] == invalid and 'Unsupported type "colour"' in out["bad schema"][1]
    assert out["no root"][0] == invalid and "end with the root" in out["no root"][1]
    assert out["gap"][0] == invalid and "previous draft's root" in out["gap"][1]
    assert out["refused"][0] == invalid and "against the session's grammar" in out["refused"][1]
    assert out["first"][0] == out["next"][0] == grpc.StatusCode.OK
