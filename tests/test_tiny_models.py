"""Tiny checkpoints: HF loadable, deterministic, both layouts, sensitive to their input."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from epd.models.reference import reference_generate
from epd.models.tiny import build_tiny_checkpoint, default_model_dir

ARCHS = ["llava", "fastvlm"]


def _chat(text, *images):
    parts = [{"type": "image_url", "image_url": {"url": str(p)}} for p in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_auto_classes_load_and_generate(arch, model_dirs, example_image_paths):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = model_dirs[arch]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == {"llava": "llava", "fastvlm": "fast_vlm"}[arch]
    assert (d / "chat_template.jinja").exists() and (d / "tokenizer.json").exists()
    proc = AutoProcessor.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d).eval()
    prompt = proc.apply_chat_template(_chat("Describe it.", "x"), add_generation_prompt=True,
                                      tokenize=False)
    assert prompt.count("<image>") == 1
    image = Image.open(example_image_paths["cat"]).convert("RGB")
    inputs = proc(text=prompt, images=[image], return_tensors="pt")
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == 16
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert 1 <= len(new) <= 12
    assert len(set(new)) > 2, "degenerate output"


@pytest.mark.parametrize("arch", ARCHS)
def test_build_is_byte_identical(arch, tmp_path, model_dirs):
    other = build_tiny_checkpoint(arch, tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "processor_config.json"):
        assert _digest(other / name) == _digest(model_dirs[arch] / name), name
    seeded = build_tiny_checkpoint(arch, tmp_path / "seed1", seed=1)
    assert _digest(seeded / "model.safetensors") != _digest(other / "model.safetensors")


def test_hub_layout_keys_and_same_outputs(tmp_path, llava_dir, example_image_paths):
    from safetensors import safe_open

    hub = build_tiny_checkpoint("llava", tmp_path / "hub", layout="hub")
    with safe_open(str(hub / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(llava_dir / "model.safetensors"), "pt") as f:
        native_keys = set(f.keys())
    assert keys != native_keys and len(keys) == len(native_keys)
    prefixes = {"vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.",
                "language_model.lm_head."}
    assert all(any(k.startswith(p) for p in prefixes) for k in keys)
    assert all(any(k.startswith(p) for k in keys) for p in prefixes)
    msgs = _chat("What is shown?", example_image_paths["sunset"])
    assert reference_generate(hub, msgs, 12) == reference_generate(llava_dir, msgs, 12)


@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_depend_on_images_prompt_and_order(arch, model_dirs, example_image_paths):
    d, p = model_dirs[arch], example_image_paths
    def gen(msgs):
        return reference_generate(d, msgs, 16).token_ids
    cat = gen(_chat("Describe it.", p["cat"]))
    assert len(set(cat)) > 3
    assert gen(_chat("Describe it.", p["sunset"])) != cat
    assert gen(_chat("What is this?", p["cat"])) != cat
    assert gen(_chat("Compare.", p["cat"], p["spiral"])) != gen(_chat("Compare.", p["spiral"], p["cat"]))


def test_default_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    first = default_model_dir("llava", "test")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("llava", "test") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent.parent == tmp_path
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # temp dir cleaned up


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_checkpoint("gpt", tmp_path)
    with pytest.raises(ValueError, match="size"):
        build_tiny_checkpoint("llava", tmp_path, size="huge")
    with pytest.raises(ValueError, match="layout"):
        build_tiny_checkpoint("llava", tmp_path, layout="weird")


def test_cli_writes_checkpoint(tmp_path, capsys, model_dirs):
    from epd.models.tiny_cli import main

    assert main(["tiny-model", "--arch", "fastvlm", "--out", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert _digest(tmp_path / "cli" / "model.safetensors") == _digest(
        model_dirs["fastvlm"] / "model.safetensors")
