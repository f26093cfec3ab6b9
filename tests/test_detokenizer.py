"""The incremental detokenizer: held-back text, flushing at the end, stop strings."""

from __future__ import annotations

import pytest

from epd.llm.detokenizer import DetokState, IncrementalDetokenizer
from epd.models import MultimodalProcessor


@pytest.fixture(scope="module")
def tokenizer(llava_dir):
    return MultimodalProcessor.from_pretrained(llava_dir).tokenizer


def stream(detok: IncrementalDetokenizer, ids: list[int], flush: bool) -> tuple[str, DetokState]:
    state, out = DetokState(), ""
    for i in range(1, len(ids) + 1):
        detok.append(state, ids[:i])
        if flush and i == len(ids):
            detok.flush(state, ids)
        out += detok.emit(state, (), final=i == len(ids))
    return out, state


def test_cut_inside_a_character_ends_like_a_full_decode(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("é日本", add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        held, _ = stream(detok, ids[:n], flush=False)
        assert full.startswith(held) and "\ufffd" not in held  # nothing partial mid-stream
        flushed, state = stream(detok, ids[:n], flush=True)
        assert flushed == full == state.text
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))


def test_stop_string_text_is_never_emitted(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("hello world, hello", add_special_tokens=False)
    state, out = DetokState(), ""
    for i in range(1, len(ids) + 1):
        detok.append(state, ids[:i])
        if detok.find_stop(state, ("world",)) is not None:
            out += detok.emit(state, ("world",), final=True)
            break
        out += detok.emit(state, ("world",), final=False)
    assert out == "hello "
