"""Token ids -> text deltas for streaming: incremental decoding, stop strings matched on the decoded text, and a
choice's whole text stream (TextStream) with vLLM's output options (TextOptions)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of ids piece by piece. Text is emitted only once it no longer ends in an incomplete
    multi-byte character (decoded as U+FFFD), so a streamed character is never split across chunks.

    Each delta is the difference of two decodes that start at the same token (`prefix`), so tokenizers whose
    decoding of a token depends on what precedes it (SentencePiece's leading space) still concatenate exactly to
    the decode of the whole sequence."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # first id of the decode window
        self.read = 0  # ids before this one have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is held back, incomplete characters included (the stream ends here)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(done) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
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

    def __init__(self, tokenizer: PreTrainedTokenizerBase, options: TextOptions) -> None:
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
