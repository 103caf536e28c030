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
                ask = DraftAsk(session, features[: position - 8], root, position, 8, None, committed)
                return status(one(drafter.draft([ask])))

            n = len(key)
            out["first"] = await status(one(drafter.draft([DraftAsk(session, features[:8], opening[-1], 8, 8, None,
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
