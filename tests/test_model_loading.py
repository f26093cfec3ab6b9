"""Split loaders: language half and vision half match the full HF model exactly."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from epd.models.loader import load_language_model, load_vision_model
from epd.models.processing import MultimodalProcessor
from epd.models.reference import (
    load_reference,
    reference_generate,
    reference_image_features,
)
from epd.models.spec import load_spec
from epd.models.tiny import build_tiny_checkpoint

ARCHS = ["llava", "fastvlm"]


@pytest.fixture(scope="module")
def llava_hub_dir(tiny_models_root):
    return build_tiny_checkpoint("llava", tiny_models_root / "llava_hub", layout="hub")


def _prompt(d, paths, text="What is this?"):
    mp = MultimodalProcessor.from_pretrained(d)
    parts = [{"type": "image_url", "image_url": {"url": str(p)}} for p in paths]
    msgs = [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]
    rendered = mp.render(msgs)
    images = [Image.open(p).convert("RGB") for p in paths]
    return mp, msgs, rendered, images


def _embeds(lm, vm, mp, rendered, images):
    inputs = mp.preprocess_images(images)
    prompt = mp.tokenize(rendered, inputs)
    ids = torch.tensor([prompt.token_ids])
    emb = lm.embed(ids).clone()
    for span, feats in zip(prompt.mm_spans, vm.encode(inputs), strict=True):
        emb[0, span.offset:span.offset + span.length] = feats
    return prompt.token_ids, emb


@pytest.mark.parametrize("arch", ARCHS)
def test_vision_features_equal_reference(arch, model_dirs, example_image_paths):
    d = model_dirs[arch]
    vm = load_vision_model(d)
    names = ("cat", "sunset", "city_street")
    pil = [Image.open(example_image_paths[n]) for n in names]
    ours = vm.encode(MultimodalProcessor.from_pretrained(d).preprocess_images(pil))
    ref = reference_image_features(d, pil)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not any("language_model" in n for n, _ in vm.named_parameters())
    _, full = load_reference(d)
    assert 0 < vm.num_parameters < sum(p.numel() for p in full.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_language_logits_equal_reference(arch, model_dirs, example_image_paths):
    d = model_dirs[arch]
    lm, vm = load_language_model(d), load_vision_model(d)
    assert not any("vision" in n or "projector" in n for n, _ in lm.named_parameters())
    mp, _, rendered, images = _prompt(d, [example_image_paths["cat"], example_image_paths["spiral"]])
    ids, emb = _embeds(lm, vm, mp, rendered, images)
    with torch.inference_mode():
        logits = lm.logits(lm(emb, torch.arange(len(ids))[None]))
        proc, model = load_reference(d)
        ref = model(**proc(text=rendered, images=images, return_tensors="pt")).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_loop_reproduces_generate(arch, model_dirs, example_image_paths):
    d = model_dirs[arch]
    lm, vm = load_language_model(d), load_vision_model(d)
    mp, msgs, rendered, images = _prompt(d, [example_image_paths["bar_chart"]], "Describe.")
    ids, emb = _embeds(lm, vm, mp, rendered, images)
    eos = set(load_spec(d).eos_token_ids)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(8):  # full recompute each step: no KV cache involved
            h = lm(emb, torch.arange(emb.shape[1])[None])
            nxt = int(lm.logits(h[:, -1]).argmax(-1))
            out.append(nxt)
            if nxt in eos:
                break
            emb = torch.cat([emb, lm.embed(torch.tensor([[nxt]]))], dim=1)
    assert out == reference_generate(d, msgs, 8).token_ids


def test_hub_layout_loads_into_both_halves(llava_dir, llava_hub_dir):
    for loader in (load_language_model, load_vision_model):
        a, b = loader(llava_dir).state_dict(), loader(llava_hub_dir).state_dict()
        assert a.keys() == b.keys() and len(a) > 0
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_attention_kwargs_reach_custom_attention(llava_dir):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        seen.append((kwargs.get("epd_batch"), attention_mask))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("epd_test_recording", recording_attention)
    custom = load_language_model(llava_dir, attn_implementation="epd_test_recording")
    sdpa = load_language_model(llava_dir)
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    pos = torch.arange(5)[None]
    marker = object()
    with torch.inference_mode():
        h1 = custom(custom.embed(ids), pos, epd_batch=marker)
        h2 = sdpa(sdpa.embed(ids), pos)
    spec = load_spec(llava_dir)
    assert len(seen) == spec.num_layers
    assert all(m is marker and mask is None for m, mask in seen)
    torch.testing.assert_close(h1, h2, rtol=0, atol=1e-6)
