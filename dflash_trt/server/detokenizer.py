"""One request's output as text, piece by piece as its tokens arrive, cut at its stop tokens and stop strings.

Why incremental with a window: decoding every new token alone breaks multi-byte characters and drops the leading
space some tokenizers attach to a word, and re-decoding the whole output each time costs O(n²). The window starts a
few tokens back (the last prompt tokens at first) so each piece decodes with its left context; a piece ending in
U+FFFD (an incomplete UTF-8 sequence) waits for the next token. Text that could be the start of a stop string is
held back until it cannot be, so a streamed stop string is never sent.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (its left context)
STOP, LENGTH = "stop", "length"  # OpenAI finish reasons


class TextStream:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str], stop_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start: decoded context for the tokens from `read`
        self.read = len(self.ids)  # tokens up to here have been turned into text
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_token_ids = stop_token_ids
        self.text = ""
        self.pending = ""  # decoded after `text` but held back: the characters before an unfinished one
        self.searched = 0  # characters of `text` searched for stop strings
        self.sent = 0  # characters of `text` handed out
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def add(self, tokens: list[int]) -> str:
        """Take one response's tokens; returns the text that may be sent now. Sets `finish_reason` to "stop"
        when a stop token or stop string ends the output (the stop itself is never part of the text). With stop
        strings the tokens are decoded one by one, so the output ends at the token that completes the first stop,
        whichever kind, and `completion_tokens` counts the tokens up to it."""
        for token in tokens:
            self.completion_tokens += 1
            if token in self.stop_token_ids:
                self.finish_reason = STOP
                return self.finish()
            self.ids.append(token)
            if self.stop:
                self._decode(final=False)
                if self._cut_at_stop_string():
                    return self._release(final=True)
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The output ended (a stop token, its budget or the engine's end): whatever text is still held back, cut
        at a stop string that only the last characters complete."""
        self._decode(final=True)
        self._cut_at_stop_string()
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        self.pending = ""
        if self.read == len(self.ids):
            return
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        else:
            self.pending = after[len(before) :].rstrip("\ufffd")

    def _cut_at_stop_string(self) -> bool:
        """Whether the text decoded since the last search (held-back characters included) completes a stop string;
        if so, the text ends before it."""
        seen = self.text + self.pending
        start = max(0, self.searched - self.hold)
        hits = [i for i in (seen.find(s, start) for s in self.stop) if i >= 0]
        self.searched = len(seen)
        if not hits:
            return False
        self.text = seen[: min(hits)]
        self.finish_reason = STOP
        return True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
