"""Shared by the gateway tests: a tiny chat target (the conftest's tiny Qwen3 plus a tokenizer that fits its 48-token
vocabulary) and the in-process backends wrapped with the info/health calls the gateway expects of a service."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.health import Backends
from gateway.rounds import Speculation, run_rounds
from protos.types import DraftAsk, DrafterInfo, SamplingParams, SessionStep, StepOutcome, VerifierInfo
from tests.conftest import VOCAB, make_target
from training.demo.tokenizer import CHAT_TEMPLATE, save_tokenizer

# ChatML specials first (ids 0-3, as in the demo tokenizer), single characters, byte-fallback tokens for "é" (C3 A9)
# and "€" (E2 82 AC) so multi-byte characters span several tokens, and the drafter's mask token last (id 47).
CHARS = list("abcdefghijklmnopqrstuvwxyz") + [" ", "\n", ".", ",", "!", "?", "'", "-", "0", "1", "2", "3"]
BYTES = ["<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
TOKENS = SPECIALS + CHARS + BYTES + ["<|mask|>"]
assert len(TOKENS) == VOCAB
MAX_CONTEXT = 1024  # the conftest targets' max_position_embeddings


def make_chat_target(path: Path, seed: int = 0) -> Path:
    """The tiny random Qwen3 target, with a character-level tokenizer (byte fallback) and the ChatML template."""
    make_target("qwen3", path, seed=seed)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|mask|>"])
    hf.chat_template = CHAT_TEMPLATE
    save_tokenizer(hf, path)
    return path


class ServiceVerifier(LocalVerifier):
    """The in-process verifier, answering info/health as the verify service does. Its steps yield to the event
    loop once, as a remote call does, so concurrent requests interleave and a request can be cancelled mid-way."""

    healthy = True

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        await asyncio.sleep(0)
        return await super().step(steps)

    async def info(self) -> VerifierInfo:
        e = self.engine
        return VerifierInfo(model_name="tiny", vocab_size=e.vocab_size, max_context_length=MAX_CONTEXT,
                            eos_token_ids=[], num_layers=e.num_layers, hidden_size=e.hidden_size, max_tree_size=64,
                            max_tree_depth=16, max_session_tokens=MAX_CONTEXT + 65,
                            max_sessions=e.fused.slots.max_sessions if e.fused is not None else 0,
                            drafts=self.stepper.drafter is not None)

    async def health(self) -> bool:
        return self.healthy


class ServiceDrafter(LocalDrafter):
    """The in-process drafter with info/health; `broken` makes every draft call fail, like a dead service."""

    healthy = True
    broken = False

    async def info(self) -> DrafterInfo:
        e = self.engine
        return DrafterInfo(block_size=e.block_size, target_layer_ids=self.target_layer_ids,
                           feature_dim=e.feature_dim, vocab_size=e.head.vocab_size, max_budget=64,
                           max_session_tokens=MAX_CONTEXT,
                           max_sessions=e.static.slots.max_sessions if e.static is not None else 0)

    async def health(self) -> bool:
        return self.healthy

    async def draft(self, asks: list[DraftAsk]):
        if self.broken:
            raise ConnectionError("drafter is gone")
        return await super().draft(asks)


def local_backends(target: Path, drafter: Path) -> Backends:
    verifier, local_drafter = load_local(str(target), str(drafter), "cpu", torch.float32)
    service_drafter = ServiceDrafter(local_drafter.engine)
    return Backends(ServiceVerifier(verifier.engine, service_drafter), service_drafter)


async def reference(backends: Backends, tokenizer, prompt: list[int], max_tokens: int,
                    spec: Speculation = Speculation("ar"), params: SamplingParams = SamplingParams()
                    ) -> tuple[str, list[int], str]:
    """(text, tokens, finish reason) of the round loop run directly on the engines: what the gateway must return."""
    rounds = [r async for r in run_rounds(backends.verifier, backends.drafter, prompt, params, spec, max_tokens,
                                          [tokenizer.eos_token_id])]
    tokens = [t for r in rounds for t in r.tokens]
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens, rounds[-1].finish_reason


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def events(body: str) -> list[dict | str]:
    """SSE body -> the data payloads, parsed (the final "[DONE]" stays a string)."""
    out: list[dict | str] = []
    for block in body.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)
