"""Incremental detokenization with stop strings.

Each `append` decodes only a small window of ids: `decode(ids[prefix:])` minus
`decode(ids[prefix:read])`. Decoding from a few tokens back (rather than the new token alone)
keeps context-dependent details right (SentencePiece leading spaces, byte-level merges); waiting
while the window ends in U+FFFD keeps multi-token characters whole.
"""
from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import SamplingParams

_WINDOW = 5        # tokens of context kept before read_offset (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
_TRIM_AT = 256     # drop consumed ids from the window list once this many pile up
_REPLACEMENT = "\ufffd"


class OutputText:
    """Output text of one sequence, built token by token. `text` never contains a matched stop
    string; `stop` is the stop string that ended it (or None)."""

    __slots__ = ("tokenizer", "skip_special_tokens", "stop_strings", "text", "stop",
                 "_ids", "_prefix", "_read", "_emitted", "_max_stop")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings: list[str] = list(params.stop_strings)
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)
        self.text = ""
        self.stop: str | None = None
        # a short tail of the prompt gives the first output tokens their decoding context
        self._ids: list[int] = list(prompt_token_ids[-(_WINDOW + 1):])
        self._read = len(self._ids)                    # ids before this are already in text (or prompt)
        self._prefix = max(self._read - _WINDOW, 0)    # decode context starts here
        self._emitted = 0                              # len of text handed out by take_delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def append(self, token_id: int) -> str | None:
        """Add one generated token. Returns the stop string if one now matches (text is cut
        before it), else None. Tokens appended after a stop are ignored."""
        if self.stop is not None:
            return self.stop
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None   # nothing new yet (special token skipped, or a character still incomplete)
        return self._add_text(new_text[len(prefix_text):])

    def _add_text(self, delta: str) -> str | None:
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        old_len = len(self.text)
        self.text += delta
        if not self.stop_strings:
            return None
        # a match must end inside the new region, so it starts at most max_stop-1 chars before it
        start = max(old_len - self._max_stop + 1, 0)
        best: tuple[int, str] | None = None
        for s in self.stop_strings:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        self.stop = best[1]
        self._emitted = min(self._emitted, len(self.text))
        return self.stop

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text, held = self.text, 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out. While unfinished, a tail that could start a stop string is
        held back. When finished, everything is flushed, including an incomplete trailing
        character (as U+FFFD, matching tokenizer.decode) unless a stop string ended the text."""
        if finished:
            if self.stop is None and self._read < len(self._ids):
                prefix_text = self._decode(self._ids[self._prefix:self._read])
                new_text = self._decode(self._ids[self._prefix:])
                if len(new_text) > len(prefix_text):
                    self._add_text(new_text[len(prefix_text):])
            end = len(self.text)
        else:
            end = max(len(self.text) - self._held_back(), self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
