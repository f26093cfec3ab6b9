"""The oracle: `transformers`' own greedy ``generate()`` on a checkpoint.

Every generation path of the engine must reproduce ``reference_generate``'s token ids.
This module depends only on transformers / PIL (not on other epd packages) so that it
stays an independent check. Image urls may be ``data:`` URLs (base64), ``file://`` URLs
or plain local paths; nothing is fetched over the network.

``token_ids`` are the generated ids only, exactly as ``generate`` returns them: if
generation stopped at an eos token, that eos id is the last element. ``text`` is
decoded with ``skip_special_tokens=True``.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass(frozen=True)
class ReferenceOutput:
    token_ids: list[int]
    text: str


_LOCK = threading.Lock()


@lru_cache(maxsize=8)
def _load(model_dir: str):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return processor, model


def load_reference(model_dir: str | Path):
    """(processor, model) for `model_dir`, loaded once per process."""
    with _LOCK:
        return _load(str(Path(model_dir).resolve()))


def load_image(url: str):
    """A PIL RGB image from a data URL, a file:// URL or a local path."""
    from PIL import Image

    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ValueError("only base64 data URLs are supported")
        try:
            raw = base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"bad base64 image data: {e}") from e
        img = Image.open(io.BytesIO(raw))
    elif url.startswith("file://"):
        img = Image.open(unquote(urlparse(url).path))
    elif "://" in url:
        raise ValueError(f"reference loader only reads local images, got {url[:40]!r}")
    else:
        img = Image.open(url)
    img.load()
    return img.convert("RGB")


def _image_sources(messages: list[dict]) -> list:
    """Image parts in order of appearance: urls (str) or PIL images (HF-style parts)."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type")
            if kind == "image_url":
                iu = part["image_url"]
                out.append(iu["url"] if isinstance(iu, dict) else iu)
            elif kind in ("image", "input_image"):
                src = part.get("image") or part.get("url") or part.get("path") or part.get("image_url")
                if src is None:
                    raise ValueError("HF-style image part without image/url/path")
                out.append(src)
    return out


def _generate(model_dir, prompt: str, images: list, max_tokens: int) -> ReferenceOutput:
    import torch

    processor, model = load_reference(model_dir)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs, do_sample=False, num_beams=1, max_new_tokens=max_tokens,
            temperature=None, top_p=None, top_k=None,
        )
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    text = processor.tokenizer.decode(ids, skip_special_tokens=True)
    return ReferenceOutput(token_ids=ids, text=text)


def render_prompt(model_dir: str | Path, messages: list[dict]) -> str:
    """The chat template applied by the HF processor, with the generation prompt."""
    processor, _ = load_reference(model_dir)
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def reference_generate(model_dir: str | Path, messages: list[dict], max_tokens: int) -> ReferenceOutput:
    """Greedy chat completion of OpenAI-style `messages` by transformers' generate()."""
    images = [s if not isinstance(s, str) else load_image(s) for s in _image_sources(messages)]
    return _generate(model_dir, render_prompt(model_dir, messages), images, max_tokens)


def reference_generate_text(model_dir: str | Path, prompt: str, max_tokens: int) -> ReferenceOutput:
    """Greedy completion of a raw prompt (no chat template; `<image>` is not allowed)."""
    return _generate(model_dir, prompt, [], max_tokens)


def reference_image_features(model_dir: str | Path, pil_images: list) -> list:
    """Per image, the rows ``get_image_features`` places into ``inputs_embeds``
    (one batched call, as ``generate`` does for the images of one prompt)."""
    import torch

    processor, model = load_reference(model_dir)
    if not pil_images:
        return []
    pixel_values = processor.image_processor([im.convert("RGB") for im in pil_images],
                                             return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        feats = model.get_image_features(pixel_values=pixel_values).pooler_output
    return [f.reshape(-1, f.shape[-1]) for f in feats]
