"""Streaming detokenization: the deltas of random token sequences concatenate to the tokenizer's own decode of the
whole sequence, for the demo target's byte-level BPE and the gateway tests' byte-fallback tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.detokenize import IncrementalDetokenizer, TextOptions, TextStream
from tests.gateway_support import SPECIALS, make_chat_target

DEMO_TARGET = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
TEXT = "abcdefghijklmnopqrstuvwxyz .,!?'-0123\n\u00e9\u20ac"  # é is two byte tokens, € three


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TARGET, local_files_only=True)


@pytest.fixture(scope="module")
def fallback_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_chat_target(tmp_path_factory.mktemp("target")), local_files_only=True)


def streamed(tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return [detok.add(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_any_byte_level_sequence_streams_to_the_whole_decode(demo_tokenizer, skip_special_tokens) -> None:
    # byte-level BPE: any ids at all, so byte tokens that split characters (or never complete one) come up too
    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(len(demo_tokenizer)) for _ in range(rng.randrange(1, 40))]
        pieces = streamed(demo_tokenizer, ids, skip_special_tokens)
        assert "".join(pieces) == demo_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_with_specials_streams_to_the_whole_decode(fallback_tokenizer, demo_tokenizer,
                                                        skip_special_tokens) -> None:
    # text of multi-byte characters, with special tokens put between any two tokens (inside a character too)
    rng = random.Random(1)
    for tokenizer in (fallback_tokenizer, demo_tokenizer):
        specials = tokenizer.convert_tokens_to_ids(SPECIALS[:3])
        for _ in range(300):
            ids = tokenizer("".join(rng.choices(TEXT, k=rng.randrange(1, 30))), add_special_tokens=False)["input_ids"]
            for _ in range(rng.randrange(4)):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            pieces = streamed(tokenizer, ids, skip_special_tokens)
            whole = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            assert "".join(pieces) == whole, ids
            # no character split across chunks (a special token kept inside one breaks it in the whole decode too)
            assert "\ufffd" in whole or all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_never_break_the_stream(fallback_tokenizer) -> None:
    # byte-fallback tokens in any order: text already sent can decode differently once more bytes come (C3 82 is
    # "Â", C3 82 E2 three replacement characters); the stream goes on with every later token's text
    ids = fallback_tokenizer.convert_tokens_to_ids(["<0xC3>", "<0x82>", "<0xE2>", "q", "<0xE2>", "<0x82>", "<0xAC>"])
    pieces = streamed(fallback_tokenizer, ids, True)
    assert pieces[1] == "\u00c2" and "".join(pieces).endswith("q\u20ac")


def test_stop_string_inside_a_streamed_text(demo_tokenizer) -> None:
    ids = demo_tokenizer("caf\u00e9 au lait, s'il vous pla\u00eet", add_special_tokens=False)["input_ids"]
    stream = TextStream(demo_tokenizer, TextOptions(stop=("s'il",), include_stop_str_in_output=True))
    out = []
    for token in ids:
        text, matched = stream.add(token, stop_token=False)
        out.append(text)
        if matched:
            break
    assert "".join(out) == "caf\u00e9 au lait, s'il"
