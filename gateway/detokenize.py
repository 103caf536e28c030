"""Token ids -> text deltas for streaming: incremental decoding, stop strings matched on the decoded text, and a
choice's whole text stream (TextStream) with vLLM's output options (TextOptions)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

# tokenizers' DecodeStream raises this when a new token changes text already decoded (invalid UTF-8 bytes that a
# later byte completes differently): its state is then unusable
INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Decodes a growing list of ids piece by piece with tokenizers' DecodeStream: each token costs one decode of a
    short window (the ids since the last emitted text plus the few before them, as context), never of the whole
    text. Text is emitted only once it no longer ends in an incomplete multi-byte character, so a streamed
    character is never split across chunks, and tokenizers whose decoding of a token depends on what precedes it
    (SentencePiece's leading space) still concatenate exactly to the decode of the whole sequence. That decode is
    the tokenizer's own: transformers' clean_up_tokenization_spaces, which it applies to non-BPE tokenizers only,
    is not applied."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # DecodeStream's window, mirrored because it is not exposed and flush() must decode what it holds back:
        # window[:context] is already emitted and decodes only as context for the rest
        self.window: list[int] = []
        self.context = 0

    def add(self, token: int) -> str:
        self.window.append(token)
        try:
            text = self.stream.step(self.tokenizer, token)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            return self._restart()
        if text is None:
            return ""
        self.window, self.context = self.window[self.context :], len(self.window) - self.context
        return text

    def _restart(self) -> str:
        """A fresh stream fed the ids not yet emitted, without the context that no longer decodes as it did (only
        invalid UTF-8 gets here, so no word's leading space is at stake)."""
        held = self.window[self.context :]
        self.stream, self.window, self.context = DecodeStream(skip_special_tokens=self.skip_special_tokens), [], 0
        return "".join(self.add(token) for token in held)

    def flush(self) -> str:
        """Whatever is held back, incomplete characters included (the stream ends here)."""
        done = self.tokenizer.decode(self.window[: self.context], skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(self.window, skip_special_tokens=self.skip_special_tokens)
        self.stream, self.window, self.context = DecodeStream(skip_special_tokens=self.skip_special_tokens), [], 0
        return text[len(done) :]


class StopStrings:
    """Matches stop strings on decoded text across token boundaries. Text that could still be the start of a stop
    string is held back. The matched stop string itself is not emitted unless `include` (vLLM's
    include_stop_str_in_output); the text ends there either way."""

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.stops = stops
        self.include = include
        self.pending = ""  # held back: the longest suffix of the text that is a prefix of some stop string

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string matched). Once matched, the stream must end."""
        self.pending += text
        hits = [(i, len(s)) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            start, length = min(hits)  # the earliest match; of two there, the shorter
            out, self.pending = self.pending[: start + length if self.include else start], ""
            return out, True
        keep = self._held_length()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _held_length(self) -> int:
        # A stop string cannot start before the held-back suffix (it would have been held back longer), so only
        # `pending` needs searching; its longest suffix that begins some stop string must stay unsent.
        for keep in range(min(len(self.pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.pending[-keep:]
            if any(s.startswith(tail) for s in self.stops):
                return keep
        return 0


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become its text (vLLM's sampling-params fields of the same names)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the matched stop string, or the stop token's text, stays in
    skip_special_tokens: bool = True


class TextStream:
    """One choice's text deltas from its committed tokens. A token that stopped the choice (EOS or a
    stop_token_ids entry) is counted but left out of the text, as vLLM does, unless include_stop_str_in_output."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, options: TextOptions) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, options.skip_special_tokens)
        self.stops = StopStrings(options.stop, options.include_stop_str_in_output)
        self.keep_stop_token = options.include_stop_str_in_output

    def add(self, token: int, stop_token: bool) -> tuple[str, bool]:
        """-> (text to emit, whether a stop string matched: the choice ends there)."""
        if stop_token and not self.keep_stop_token:
            return "", False
        return self.stops.feed(self.detok.add(token))

    def finish(self) -> tuple[str, bool]:
        """The held-back rest once the tokens have ended; -> (text, whether a stop string matched in it)."""
        tail, matched = self.stops.feed(self.detok.flush())
        return tail + ("" if matched else self.stops.flush()), matched
