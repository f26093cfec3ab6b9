"""In-process tests of the encoder engine: features, batching, single flight, cache, leases."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from epd.encoder.config import EncoderConfig
from epd.encoder.engine import EncoderEngine
from epd.errors import EPDError
from epd.models import MultimodalProcessor, load_spec, load_vision_model
from epd.models.reference import reference_image_features

IMAGES = Path(__file__).resolve().parent.parent / "examples" / "images"
NAMES = ("sunset.png", "cat.png", "city_street.jpg", "bar_chart.jpg", "spiral.webp")


def _image(name: str) -> Image.Image:
    return Image.open(IMAGES / name).convert("RGB")


class CountingVision:
    """The real vision model, recording the batch size of every forward."""

    def __init__(self, inner, fail: bool = False) -> None:
        self.inner = inner
        self.num_parameters = inner.num_parameters
        self.batches: list[int] = []
        self.fail = fail

    def encode(self, images):
        self.batches.append(len(images))
        if self.fail:
            raise RuntimeError("injected vision failure")
        return self.inner.encode(images)


@dataclasses.dataclass
class Parts:
    model_dir: Path
    spec: object
    processor: object
    vision: object
    inputs: dict[str, object]  # image name -> ImageInput


def _parts(model_dir: Path) -> Parts:
    processor = MultimodalProcessor.from_pretrained(model_dir)
    inputs = {n: processor.preprocess_images([_image(n)])[0] for n in NAMES}
    vision = load_vision_model(model_dir, dtype=torch.float32, device="cpu")
    return Parts(model_dir, load_spec(model_dir), processor, vision, inputs)


@pytest.fixture(scope="module")
def llava(llava_dir) -> Parts:
    return _parts(Path(llava_dir))


@pytest.fixture(scope="module")
def fastvlm(fastvlm_dir) -> Parts:
    return _parts(Path(fastvlm_dir))


def _blocks_per_image(parts: Parts, block_tokens: int = 4) -> int:
    n = parts.inputs["sunset.png"].num_tokens
    assert all(inp.num_tokens == n for inp in parts.inputs.values())
    return -(-n // block_tokens)


def make_engine(parts: Parts, *, fail: bool = False, **overrides) -> EncoderEngine:
    fields = {"mm_block_tokens": 4, "mm_num_blocks": 64, "batch_window_ms": 20.0}
    fields.update(overrides)
    config = EncoderConfig(model=str(parts.model_dir), **fields)
    vision = CountingVision(parts.vision, fail=fail)
    return EncoderEngine(config, vision_model=vision, processor=parts.processor, spec=parts.spec)


def run(engine: EncoderEngine, scenario):
    """Run `scenario(engine)` on a fresh loop with the engine started; check integrity."""

    async def main():
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.stop()
            engine.check_integrity()

    return asyncio.run(main())


def encode(engine: EncoderEngine, parts: Parts, *names: str):
    inputs = [parts.inputs[n] for n in names]
    return engine.encode_inputs(inputs, [f"content[{i}]" for i in range(len(names))])


def rows(engine: EncoderEngine, ref) -> torch.Tensor:
    blocks = engine.cache.tensor[ref.block_ids]
    return blocks.reshape(-1, engine.hidden_size)[: ref.num_tokens]


@pytest.mark.parametrize("arch", ["llava", "fastvlm"])
def test_cached_features_equal_reference(arch, request):
    parts: Parts = request.getfixturevalue(arch)
    engine = make_engine(parts)
    images = [_image("sunset.png"), _image("city_street.jpg")]

    refs = run(engine, lambda e: e.encode(images))
    expected = reference_image_features(parts.model_dir, images)
    assert len(refs) == 2
    for ref, want in zip(refs, expected, strict=True):
        assert ref.num_tokens == want.shape[0] > 0
        assert ref.hidden_size == want.shape[1] == parts.spec.hidden_size
        assert ref.dtype == "float32" and ref.block_tokens == 4 and ref.grid_thw is None
        assert len(ref.block_ids) == -(-ref.num_tokens // 4)
        torch.testing.assert_close(rows(engine, ref), want.float(), atol=1e-5, rtol=1e-4)
    assert not torch.equal(rows(engine, refs[0]), rows(engine, refs[1]))
    assert engine.vision.batches == [2]  # both images in one forward
    assert engine.stats()["leases"] == 2


def test_concurrent_requests_share_one_forward(llava):
    engine = make_engine(llava, max_batch_images=2)

    async def scenario(e):
        a, b, c = await asyncio.gather(
            encode(e, llava, "sunset.png"),
            encode(e, llava, "cat.png"),
            encode(e, llava, "bar_chart.jpg"),
        )
        return a + b + c

    refs = run(engine, scenario)
    assert engine.vision.batches == [2, 1]  # capped at max_batch_images
    stats = engine.stats()
    assert (stats["forwards"], stats["encodes"], stats["misses"], stats["hits"]) == (2, 3, 3, 0)
    assert len({tuple(r.block_ids) for r in refs}) == 3


def test_single_flight_encodes_once(llava):
    engine = make_engine(llava)

    async def scenario(e):
        results = await asyncio.gather(*(encode(e, llava, "cat.png") for _ in range(8)))
        e.check_integrity()
        refs = [r[0] for r in results]
        entry = e.cache.peek(refs[0].mm_hash)
        assert entry is not None and entry.ref_count == 8
        assert e.release(r.lease_id for r in refs) == 8
        return refs

    refs = run(engine, scenario)
    assert engine.vision.batches == [1]
    assert {tuple(r.block_ids) for r in refs} == {tuple(refs[0].block_ids)}
    assert len({r.lease_id for r in refs}) == 8
    stats = engine.stats()
    assert (stats["encodes"], stats["misses"], stats["hits"]) == (1, 1, 7)
    assert stats["blocks_referenced"] == 0 and stats["leases"] == 0
    assert stats["entries"] == 1  # unreferenced, still cached


def test_repeat_is_a_cache_hit_and_release_is_idempotent(llava):
    engine = make_engine(llava)

    async def scenario(e):
        (first,) = await encode(e, llava, "sunset.png")
        assert e.release([first.lease_id]) == 1
        assert e.release([first.lease_id, "no-such-lease"]) == 0
        (second,) = await encode(e, llava, "sunset.png")
        assert second.lease_id != first.lease_id
        return first, second

    first, second = run(engine, scenario)
    assert first.block_ids == second.block_ids and first.mm_hash == second.mm_hash
    assert engine.vision.batches == [1]
    assert (engine.stats()["hits"], engine.stats()["leases"]) == (1, 1)


def test_lru_eviction(llava):
    per_image = _blocks_per_image(llava)
    engine = make_engine(llava, mm_num_blocks=2 * per_image)

    async def scenario(e):
        async def once(name):
            (ref,) = await encode(e, llava, name)
            e.release([ref.lease_id])
            e.check_integrity()
            return ref

        a = await once("sunset.png")
        b = await once("cat.png")
        await once("sunset.png")  # a hit: sunset becomes most recently used
        c = await once("city_street.jpg")  # evicts cat (least recently used)
        assert e.cache.peek(b.mm_hash) is None
        assert e.cache.peek(a.mm_hash) is not None and e.cache.peek(c.mm_hash) is not None
        assert sorted(c.block_ids) == sorted(b.block_ids)  # reused cat's blocks
        await once("cat.png")  # a miss again, evicts sunset
        assert e.cache.peek(a.mm_hash) is None

    run(engine, scenario)
    stats = engine.stats()
    assert (stats["encodes"], stats["hits"], stats["evictions"]) == (4, 1, 2)
    assert engine.vision.batches == [1, 1, 1, 1]


def test_full_pool_waits_then_503(llava):
    engine = make_engine(llava, mm_num_blocks=_blocks_per_image(llava), alloc_timeout_seconds=0.3)

    async def scenario(e):
        (held,) = await encode(e, llava, "sunset.png")
        with pytest.raises(EPDError) as info:
            await encode(e, llava, "cat.png")
        assert info.value.status == 503
        assert int(info.value.headers["Retry-After"]) >= 1
        e.check_integrity()
        assert e.stats()["blocks_referenced"] == len(held.block_ids)
        # A release while a request waits lets that request through.
        waiting = asyncio.ensure_future(encode(e, llava, "cat.png"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        e.release([held.lease_id])
        (got,) = await waiting
        return got

    got = run(engine, scenario)
    stats = engine.stats()
    assert stats["alloc_timeouts"] == 1 and stats["evictions"] == 1
    assert stats["blocks_referenced"] == len(got.block_ids)


def test_image_larger_than_pool_is_400(llava):
    engine = make_engine(llava, mm_num_blocks=1)

    async def scenario(e):
        with pytest.raises(EPDError) as info:
            await encode(e, llava, "cat.png")
        return info.value

    err = run(engine, scenario)
    assert (err.status, err.param) == (400, "content[0]")
    assert engine.vision.batches == []


def test_lease_expiry_releases_refs(llava):
    engine = make_engine(llava, lease_seconds=0.2)

    async def scenario(e):
        a, b = await encode(e, llava, "sunset.png", "cat.png")
        assert e.expire_leases(now=time.monotonic() - 1) == 0
        assert e.stats()["blocks_referenced"] > 0
        # The periodic sweep frees them without any ack.
        for _ in range(100):
            if e.stats()["leases"] == 0:
                break
            await asyncio.sleep(0.05)
        e.check_integrity()
        assert e.release([a.lease_id, b.lease_id]) == 0  # already ended: a no-op
        return e.stats()

    stats = run(engine, scenario)
    assert stats["leases"] == 0 and stats["blocks_referenced"] == 0
    assert stats["leases_expired"] == 2 and stats["leases_released"] == 0
    assert stats["entries"] == 2  # expired refs leave the features cached


def test_failed_forward_frees_blocks_and_engine_recovers(llava):
    engine = make_engine(llava, fail=True)

    async def scenario(e):
        results = await asyncio.gather(
            *(encode(e, llava, "sunset.png") for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, EPDError) and r.status == 500 for r in results)
        e.check_integrity()
        assert e.stats()["blocks_used"] == 0 and e.stats()["entries"] == 0
        e.vision.fail = False
        return await encode(e, llava, "sunset.png", "cat.png")

    refs = run(engine, scenario)
    assert len(refs) == 2
    assert engine.vision.batches == [1, 2]
    assert engine.stats()["leases"] == 2


def test_failure_of_one_image_releases_the_others(llava):
    engine = make_engine(llava, mm_num_blocks=_blocks_per_image(llava), alloc_timeout_seconds=0.1)

    async def scenario(e):
        with pytest.raises(EPDError) as info:
            await encode(e, llava, "sunset.png", "cat.png")  # the pool holds only one
        assert info.value.status == 503
        return e.stats()

    stats = run(engine, scenario)
    assert stats["blocks_referenced"] == 0 and stats["leases"] == 0


def test_flags_make_a_validated_config(tmp_path):
    import argparse

    from epd.encoder.server import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, role="encoder")
    args = parser.parse_args(
        ["--model", str(tmp_path), "--mm-cache-memory", "2MiB", "--allowed-media-domains",
         "a.example,b.example", "c.example", "--device", "cpu", "--encoder-id", "enc-1"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.mm_cache_memory == 2 * 1024**2 and config.mm_num_blocks is None
    assert config.allowed_media_domains == ("a.example", "b.example", "c.example")
    assert (config.host, config.port, config.encoder_id) == ("127.0.0.1", 8100, "enc-1")
    assert (config.max_batch_images, config.mm_block_tokens, config.lease_seconds) == (16, 16, 60)
    assert config.url == "http://127.0.0.1:8100"
    with pytest.raises(SystemExit):  # one pool sizing only
        parser.parse_args(["--model", "m", "--mm-cache-memory", "1MiB", "--mm-num-blocks", "4"])
    with pytest.raises(ValueError, match="lease_seconds"):
        EncoderConfig(model="m", lease_seconds=0)
    with pytest.raises(ValueError, match="transfer"):
        EncoderConfig(model="m", transfer="carrier-pigeon")


def test_engine_loads_only_the_vision_part(llava_dir):
    from epd.models import VisionModel
    from epd.models.reference import load_reference

    engine = EncoderEngine(EncoderConfig(model=str(llava_dir), mm_num_blocks=8))
    assert isinstance(engine.vision, VisionModel)
    assert engine.dtype == torch.float32 and engine.hidden_size == load_spec(llava_dir).hidden_size
    full = load_reference(llava_dir)[1].model
    vision_only = [*full.vision_tower.parameters(), *full.multi_modal_projector.parameters()]
    assert engine.vision.num_parameters == sum(p.numel() for p in vision_only)
    assert getattr(engine.vision.inner, "language_model", None) is None
    assert engine.cache.tensor.shape == (8, 16, engine.hidden_size)
