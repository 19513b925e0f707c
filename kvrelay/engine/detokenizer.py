"""Incremental detokenisation with stop strings, for streaming.

Text is produced token by token without re-decoding the whole output: decode a
small window `ids[prefix:]` and emit what it adds beyond `ids[prefix:read]`,
holding back while the window ends in an incomplete UTF-8 sequence ("\ufffd").

    ids:     ... p0 p1 p2 | o0 o1 o2 o3
                 ^prefix      ^read (text up to here already emitted)

Stop strings are searched in the accumulated text (only where the newest delta
could complete one). While a request runs, the last `max(len(stop)) - 1`
characters are withheld so a stream never shows text that turns out to begin a
stop string; the text is trimmed at the stop (unless `include_stop_str_in_output`).
"""
from __future__ import annotations

from collections.abc import Sequence

from kvrelay.model.tokenizer import CheckpointTokenizer

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5          # prompt tokens that seed the window (leading-space rules)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: CheckpointTokenizer, prompt_ids: Sequence[int],
                 stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""                      # all output text so far (trimmed at a stop)
        self.emitted = 0                    # characters of `text` already handed out
        self.stop, self.include_stop = list(stop), include_stop
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped_on: str | None = None

    def add(self, token_ids: Sequence[int]) -> str | None:
        """Feed new tokens; returns the stop string that matched, if any."""
        for token in token_ids:
            if self.stopped_on is not None:
                break
            self.ids.append(token)
            before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
            after = self.tok.decode(self.ids[self.prefix:], self.skip)
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                start = len(self.text)
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
                self._find_stop(start)
        return self.stopped_on

    def _find_stop(self, new_from: int) -> None:
        for stop in self.stop:
            at = self.text.find(stop, max(new_from - len(stop) + 1, 0))
            if at >= 0:
                self.text = self.text[:at + (len(stop) if self.include_stop else 0)]
                self.stopped_on = stop
                return

    def take(self, finished: bool) -> str:
        """The text not yet handed out (all of it once the request finished)."""
        end = (len(self.text) if finished or self.stopped_on
               else max(len(self.text) - self.holdback, self.emitted))
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
