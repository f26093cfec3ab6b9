"""Incremental detokenization with stop strings.

Invariants: the text handed out so far is always a prefix of the final text; it never
contains a stop string (or its beginning, while a match is still possible); an
incomplete UTF-8 sequence (a trailing U+FFFD) is held back until it completes, or until
the request finishes (`flush`): then the final text equals a full decode of the output
ids, as transformers returns it (a trailing U+FFFD included). Each new
token decodes only a short window of tokens (prefix/read offsets, as in vLLM/TGI).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # everything decoded so far
    num_emitted: int = 0  # chars of `text` handed out


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, state: DetokState, ids: list[int]) -> None:
        """Decode what the last token of `ids` (all output tokens) adds to state.text."""
        prefix = self._decode(ids[state.prefix_offset : state.read_offset])
        full = self._decode(ids[state.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.text += full[len(prefix) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(ids)

    def flush(self, state: DetokState, ids: list[int]) -> None:
        """At the end of a request: add what `append` held back (an incomplete UTF-8
        sequence decodes to U+FFFD, exactly as a full decode of `ids` returns it)."""
        prefix = self._decode(ids[state.prefix_offset : state.read_offset])
        full = self._decode(ids[state.prefix_offset :])
        if len(full) > len(prefix) and full.startswith(prefix):
            state.text += full[len(prefix) :]
        state.prefix_offset = state.read_offset = len(ids)

    @staticmethod
    def find_stop(state: DetokState, stop: tuple[str, ...]) -> str | None:
        """If a stop string occurs in the text, truncate the text before it and return it."""
        if not stop:
            return None
        window_start = max(0, state.num_emitted - max(len(s) for s in stop))
        best: tuple[int, str] | None = None
        for s in stop:
            i = state.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        state.text = state.text[: best[0]]
        return best[1]

    @staticmethod
    def emit(state: DetokState, stop: tuple[str, ...], final: bool) -> str:
        """The next text delta; holds back a possible stop-string prefix unless final."""
        end = len(state.text)
        if not final:
            for s in stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if state.text.endswith(s[:k]):
                        end = min(end, len(state.text) - k)
                        break
        if end <= state.num_emitted:
            return ""
        delta = state.text[state.num_emitted : end]
        state.num_emitted = end
        return delta
