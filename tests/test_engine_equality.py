"""The engine reproduces transformers' greedy generate() token for token.

Both tiny archs, text-only and 1-3 images, >= 8 concurrent requests of different lengths,
with chunked prefill forced (tiny token budget), with preemption forced (tiny KV cache),
with prefix-cache reuse; after every run the KV cache is intact and entirely free.
Also: stop conditions, abort, and the async engine's streams / cancellation.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from epd.llm.api import LLM
from epd.llm.async_engine import AsyncLLMEngine
from epd.llm.config import EngineConfig
from epd.llm.sampling_params import SamplingParams
from epd.models.reference import reference_generate

IMAGES = Path(__file__).resolve().parent.parent / "examples" / "images"
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def image(name: str, data_url: bool = False) -> dict:
    path = IMAGES / name
    url = str(path)
    if data_url:
        url = "data:image/webp;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


SYSTEM = {"role": "system", "content": "You are a careful assistant who describes scenes in detail."}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Tell me a long story about the sea, the sunset, the city "
                                 "street at night and a cat that walks along the harbour."}],
    [SYSTEM, {"role": "user", "content": "What do you see?"}],
    [user(image("cat.png"), text("What is in the picture?"))],
    [user(text("Describe this:"), image("sunset.png"))],
    [user(image("bar_chart.jpg"), image("city_street.jpg"), text("Compare the two images."))],
    [user(image("spiral.webp"), text("first"), image("cat.png"), image("sunset.png"))],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hello there."},
     {"role": "user", "content": "Now count to five."}],
    [user(image("spiral.webp", data_url=True), text("And this one?"))],
]

_REFS: dict[tuple[str, int], list[int]] = {}


def reference(model_dir: Path, i: int, convs=CONVERSATIONS) -> list[int]:
    key = (str(model_dir), id(convs[i]))
    if key not in _REFS:
        _REFS[key] = reference_generate(model_dir, convs[i], MAX_TOKENS).token_ids
    return _REFS[key]


@pytest.fixture(params=["llava", "fastvlm"])
def model_dir(request) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


def assert_idle_and_intact(llm: LLM) -> None:
    engine = llm.engine
    engine.blocks.check_integrity()
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.blocks.num_used_blocks == 0


def test_batch_with_chunked_prefill_matches_reference(model_dir):
    llm = LLM(model_dir, block_size=8, num_blocks=256, max_num_batched_tokens=16)
    outs = llm.generate(CONVERSATIONS, GREEDY)
    for i, out in enumerate(outs):
        assert out.token_ids == reference(model_dir, i), f"conversation {i}"
    prompt_lens = {o.num_prompt_tokens for o in outs}
    assert len(prompt_lens) >= 6 and max(prompt_lens) > 16  # really chunked, varied
    assert llm.engine.stats().num_steps > len(outs)
    assert_idle_and_intact(llm)


def test_preemption_by_recompute_matches_reference(model_dir):
    llm = LLM(model_dir, block_size=8, num_blocks=20, max_num_batched_tokens=64)
    outs = llm.generate(CONVERSATIONS, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    for i, out in enumerate(outs):
        assert out.token_ids == reference(model_dir, i), f"conversation {i}"
    assert_idle_and_intact(llm)


def test_prefix_cache_reuse_matches_reference(model_dir):
    first = [CONVERSATIONS[2], CONVERSATIONS[3]]
    second = [
        [SYSTEM, {"role": "user", "content": "Anything else to add?"}],
        [user(image("cat.png"), text("Is it an animal?"))],
    ]
    llm = LLM(model_dir, block_size=4, num_blocks=128)
    a = llm.generate(first, GREEDY)
    b = llm.generate(second, GREEDY)
    assert [o.token_ids for o in a] == [reference(model_dir, i, first) for i in range(2)]
    assert [o.token_ids for o in b] == [reference(model_dir, i, second) for i in range(2)]
    assert all(o.num_cached_tokens == 0 for o in a)
    assert all(o.num_cached_tokens >= 8 for o in b)  # same system prompt / same image
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_idle_and_intact(llm)


def test_stop_token_ids_and_stop_strings(llava_dir):
    conv = CONVERSATIONS[1]
    ref = reference_generate(llava_dir, conv, MAX_TOKENS)
    llm = LLM(llava_dir, num_blocks=64)
    stop_tok = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(ref.token_ids[3],))
    out = llm.generate(conv, stop_tok)[0]
    k = ref.token_ids.index(ref.token_ids[3])
    assert out.token_ids == ref.token_ids[: k + 1] and out.finish_reason == "stop"
    clean = ref.text.replace("\ufffd", "")
    stop = clean[len(clean) // 2 : len(clean) // 2 + 3]
    out = llm.generate(conv, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == ref.text[: ref.text.find(stop)] and stop not in out.text
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    out = llm.generate(conv, GREEDY)[0]
    assert out.finish_reason == "length" and out.text == ref.text
    assert_idle_and_intact(llm)


def test_abort_mid_generation_frees_everything(llava_dir):
    llm = LLM(llava_dir, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = engine.processor.tokenize(engine.processor.render(CONVERSATIONS[1]), []).token_ids
    for rid in ("a", "b", "c"):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    assert engine.abort("b") and not engine.abort("nope")
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    aborted = [o for o in outs if o.request_id == "b"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    done = {o.request_id: o for o in outs if o.finished}
    assert done["a"].finish_reason == done["c"].finish_reason == "length"
    assert_idle_and_intact(llm)


def test_async_engine_streams_and_cancellation(llava_dir):
    engine = AsyncLLMEngine(EngineConfig(model_dir=llava_dir, num_blocks=64, block_size=4))
    conv = CONVERSATIONS[3]
    proc = engine.processor
    images = proc.preprocess_images([__import__("PIL.Image").Image.open(IMAGES / "cat.png").convert("RGB")])
    prompt = proc.tokenize(proc.render(conv), images)
    from epd.llm.sequence import MMItem

    def items():
        return [MMItem(s.offset, s.length, im.mm_hash, image=im)
                for s, im in zip(prompt.mm_spans, images, strict=True)]

    async def main():
        tokens, text, finals = [], "", []
        async for out in engine.generate("r1", prompt.token_ids, GREEDY, items()):
            tokens += out.new_token_ids
            text += out.new_text
            finals.append(out.finished)
        # A consumer that leaves after the first token aborts its request.
        stream = engine.generate("r2", prompt.token_ids, SamplingParams(max_tokens=200, temperature=0), items())
        first = await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            s = engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total:
                break
            await asyncio.sleep(0.02)
        return tokens, text, finals, first

    engine.start()
    try:
        tokens, text, finals, first = asyncio.run(main())
    finally:
        engine.shutdown()
    ref = reference_generate(llava_dir, conv, MAX_TOKENS)
    assert tokens == ref.token_ids and text == ref.text
    assert finals[-1] and not any(finals[:-1])
    assert first.new_token_ids == ref.token_ids[:1]
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total)
    engine.engine.blocks.check_integrity()


def test_seeded_sampling_is_reproducible_alone_batched_and_preempted(llava_dir):
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7)
    alone = LLM(llava_dir, num_blocks=64).generate(CONVERSATIONS[5], seeded)[0]
    llm = LLM(llava_dir, block_size=8, num_blocks=20, max_num_batched_tokens=16)
    engine = llm.engine
    reqs = [llm._chat_request(c) for c in CONVERSATIONS]
    for i, (tokens, items) in enumerate(reqs):
        engine.add_request(f"r{i}", tokens, seeded if i == 5 else GREEDY, items)
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == "r5" for t in o.new_token_ids]
    assert engine.stats().num_preemptions > 0
    assert got == alone.token_ids
    assert got != reference(llava_dir, 5)  # it really sampled
    assert_idle_and_intact(llm)


def test_forward_error_fails_only_that_batch_and_frees_blocks(llava_dir, monkeypatch):
    llm = LLM(llava_dir, num_blocks=64)
    engine = llm.engine
    engine.add_request("bad", [5, 6, 7, 8], GREEDY)

    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(engine.runner, "execute", boom)
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "error" and "kaboom" in out.error
    monkeypatch.undo()
    assert llm.generate_prompts([[5, 6, 7, 8]], GREEDY)[0].finish_reason == "length"
    assert_idle_and_intact(llm)
