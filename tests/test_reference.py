"""The reference oracle: transformers' greedy generate() behind a tiny API."""

from __future__ import annotations

import base64

import pytest
from PIL import Image

from epd.models.reference import (
    ReferenceOutput,
    load_image,
    reference_generate,
    reference_generate_text,
    reference_image_features,
)
from epd.models.spec import load_spec

ARCHS = ["llava", "fastvlm"]


def _msgs(url, text="Describe the picture."):
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": text}]},
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_url_forms_give_the_same_tokens(arch, model_dirs, example_image_paths):
    path = example_image_paths["cat"]
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    outs = [reference_generate(model_dirs[arch], _msgs(u), 10)
            for u in (str(path), path.as_uri(), data_url)]
    assert isinstance(outs[0], ReferenceOutput)
    assert outs[0] == outs[1] == outs[2]
    assert 1 <= len(outs[0].token_ids) <= 10
    assert isinstance(outs[0].text, str)


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_is_last_if_present_and_text_only_chat(arch, model_dirs):
    eos = set(load_spec(model_dirs[arch]).eos_token_ids)
    out = reference_generate(model_dirs[arch], [{"role": "user", "content": "Tell a story."}], 24)
    assert len(out.token_ids) <= 24
    assert all(t not in eos for t in out.token_ids[:-1])
    again = reference_generate(model_dirs[arch], [{"role": "user", "content": "Tell a story."}], 24)
    assert again == out


@pytest.mark.parametrize("arch", ARCHS)
def test_raw_prompt_completion(arch, model_dirs):
    a = reference_generate_text(model_dirs[arch], "The cat sat on the", 6)
    b = reference_generate_text(model_dirs[arch], "The sea was", 6)
    assert len(a.token_ids) == 6 or a.token_ids[-1] in load_spec(model_dirs[arch]).eos_token_ids
    assert a.token_ids != b.token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_image_features_shape(arch, model_dirs, example_image_paths):
    ims = [Image.open(example_image_paths[n]) for n in ("cat", "bar_chart")]
    feats = reference_image_features(model_dirs[arch], ims)
    spec = load_spec(model_dirs[arch])
    assert [tuple(f.shape) for f in feats] == [(spec.image_seq_length, spec.hidden_size)] * 2
    assert not feats[0].equal(feats[1])


def test_load_image_rejects_remote_and_bad_data():
    with pytest.raises(ValueError):
        load_image("http://example.com/a.png")
    with pytest.raises(ValueError):
        load_image("data:image/png;base64,!!!notbase64")
