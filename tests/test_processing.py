"""MultimodalProcessor: chat rendering, image preprocessing, placeholder expansion."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from epd.models.processing import ImagePart, MMSpan, MultimodalProcessor, image_urls
from epd.models.spec import load_spec

ARCHS = ["llava", "fastvlm"]


def _parts(*items):
    return [{"type": "text", "text": i} if isinstance(i, str) and not i.startswith("/")
            else {"type": "image_url", "image_url": {"url": str(i)}} for i in items]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("names", [(), ("cat",), ("cat", "spiral"), ("sunset", "sunset")])
def test_token_ids_match_hf_processor(arch, names, model_dirs, example_image_paths):
    d = model_dirs[arch]
    mp = MultimodalProcessor.from_pretrained(d)
    paths = [example_image_paths[n] for n in names]
    content = _parts("Look:", *paths, "and", "tell me.") if paths else "Just text."
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": content}]
    text = mp.render(messages)
    images = [Image.open(p).convert("RGB") for p in paths]
    prompt = mp.tokenize(text, mp.preprocess_images(images))
    hf = AutoProcessor.from_pretrained(d)(text=text, images=images or None, return_tensors="pt")
    assert prompt.token_ids == hf["input_ids"][0].tolist()
    n = load_spec(d).image_seq_length
    assert [s.length for s in prompt.mm_spans] == [n] * len(names)
    if len(names) == 2:  # adjacent images: adjacent spans
        assert prompt.mm_spans[1].offset == prompt.mm_spans[0].offset + n
    for s in prompt.mm_spans:
        assert set(prompt.token_ids[s.offset:s.offset + s.length]) == {mp.image_token_id}
    assert prompt.token_ids.count(mp.image_token_id) == n * len(names)


@pytest.mark.parametrize("arch", ARCHS)
def test_preprocess_and_hash(arch, model_dirs, example_image_paths):
    mp = MultimodalProcessor.from_pretrained(model_dirs[arch])
    cat = Image.open(example_image_paths["cat"])
    a, b, c = mp.preprocess_images([cat, cat.copy(), Image.open(example_image_paths["spiral"])])
    assert a.pixel_values.shape[0] == 1 and a.pixel_values.dtype == torch.float32
    assert a.num_tokens == load_spec(model_dirs[arch]).image_seq_length
    assert a.mm_hash == b.mm_hash != c.mm_hash
    assert len(a.mm_hash) == 64


def test_hash_covers_preprocessing_params(model_dirs, example_image_paths):
    cat = Image.open(example_image_paths["cat"])
    hashes = {MultimodalProcessor.from_pretrained(model_dirs[a]).preprocess_images([cat])[0].mm_hash
              for a in ARCHS}
    assert len(hashes) == 2


def test_render_roles_and_hf_style_image_parts(llava_dir, fastvlm_dir):
    msgs = [{"role": "system", "content": "S."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q1"}]},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": [{"type": "text", "text": "Q2"}]}]
    text = MultimodalProcessor.from_pretrained(llava_dir).render(msgs)
    assert text == "<s>S.\nUSER: <image>Q1\nASSISTANT: A1</s>\nUSER: Q2\nASSISTANT:"
    chatml = MultimodalProcessor.from_pretrained(fastvlm_dir).render(msgs)
    assert chatml.endswith("<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    assert chatml.count("<image>") == 1


def test_placeholder_count_mismatch_raises(llava_dir, example_image_paths):
    mp = MultimodalProcessor.from_pretrained(llava_dir)
    images = mp.preprocess_images([Image.open(example_image_paths["cat"])])
    with pytest.raises(ValueError, match="placeholder"):
        mp.tokenize("no image here", images)
    with pytest.raises(ValueError, match="placeholder"):
        mp.tokenize("<image><image>", images)


def test_image_urls_in_order():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": "u1"}},
                                         {"type": "image", "url": "u2"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u3"}}]}]
    assert image_urls(msgs) == [ImagePart(1, 1, "u1"), ImagePart(1, 2, "u2"), ImagePart(2, 0, "u3")]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]"):
        image_urls([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_eos_ids_and_span_type(llava_dir, fastvlm_dir):
    assert MultimodalProcessor.from_pretrained(llava_dir).eos_token_ids == (2,)
    assert len(MultimodalProcessor.from_pretrained(fastvlm_dir).eos_token_ids) == 2
    assert MMSpan(3, 4) == MMSpan(offset=3, length=4)
