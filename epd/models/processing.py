"""Prompt processing shared by the encoder (images) and the LLM engine (text).

Invariants:
- ``render`` is the checkpoint's chat template with the generation prompt, exactly as
  the HF processor renders it; each image part becomes one ``<image>`` placeholder.
- ``tokenize(text, images)`` expands the i-th placeholder to ``images[i].num_tokens``
  image-token ids, giving exactly the HF processor's ``input_ids``; ``mm_spans[i]`` is
  where image i's feature rows go (adjacent images get adjacent spans).
- ``ImageInput.mm_hash`` identifies the preprocessed pixels: sha256 over their bytes,
  shape, dtype and the image processor's parameters (so a cached embedding is reused
  only for the same model input).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class ImageInput:
    pixel_values: torch.Tensor  # this image only, batch dim 1
    num_tokens: int
    extra: dict = field(default_factory=dict)  # other per-image model kwargs (batch dim 1)
    mm_hash: str = ""


@dataclass(frozen=True)
class MMSpan:
    offset: int
    length: int


@dataclass
class PromptInputs:
    token_ids: list[int]
    mm_spans: list[MMSpan]


@dataclass(frozen=True)
class ImagePart:
    message_index: int
    part_index: int
    url: str


def image_urls(messages: list[dict]) -> list[ImagePart]:
    """Image parts of OpenAI-style messages (and HF-style ``{"type": "image"}``), in order."""
    out: list[ImagePart] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
            elif kind in ("image", "input_image"):
                url = part.get("url") or part.get("image_url") or part.get("path") or part.get("image")
            else:
                continue
            if not isinstance(url, str):
                raise ValueError(f"messages[{i}].content[{j}]: image part without a url string")
            out.append(ImagePart(i, j, url))
    return out


class MultimodalProcessor:
    def __init__(self, hf_processor, eos_token_ids: tuple[int, ...]):
        self.hf_processor = hf_processor
        self.tokenizer = hf_processor.tokenizer
        self.image_processor = hf_processor.image_processor
        self.image_token: str = getattr(hf_processor, "image_token", "<image>")
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.eos_token_ids = eos_token_ids
        params = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        self._params_digest = hashlib.sha256(params.encode()).hexdigest()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> MultimodalProcessor:
        from transformers import AutoProcessor

        from epd.models.spec import load_spec

        return cls(AutoProcessor.from_pretrained(str(model_dir)), load_spec(model_dir).eos_token_ids)

    def render(self, messages: list[dict]) -> str:
        return self.hf_processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _num_tokens(self, pixel_values: torch.Tensor, image) -> int:
        p = self.hf_processor
        if type(p).__name__ == "LlavaProcessor":  # mirrors LlavaProcessor.replace_image_token
            h, w = pixel_values.shape[-2:]
            n = (h // p.patch_size) * (w // p.patch_size) + p.num_additional_image_tokens
            return n - 1 if p.vision_feature_select_strategy == "default" else n
        ids = p(text=self.image_token, images=[image], return_tensors="pt")["input_ids"]
        return int((ids == self.image_token_id).sum())

    def preprocess_images(self, images: list) -> list[ImageInput]:
        out = []
        for image in images:
            feats = self.image_processor([image.convert("RGB")], return_tensors="pt")
            pixel_values = feats.pop("pixel_values")
            extra = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor)}
            h = hashlib.sha256()
            h.update(self._params_digest.encode())
            h.update(f"{tuple(pixel_values.shape)}|{pixel_values.dtype}".encode())
            h.update(pixel_values.contiguous().numpy().tobytes())
            out.append(ImageInput(pixel_values, self._num_tokens(pixel_values, image), extra,
                                  h.hexdigest()))
        return out

    def tokenize(self, text: str, images: list[ImageInput]) -> PromptInputs:
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"prompt has {len(pieces) - 1} image placeholders but {len(images)} images"
            )
        expanded = pieces[0]
        for img, piece in zip(images, pieces[1:], strict=True):
            expanded += self.image_token * img.num_tokens + piece
        ids = self.tokenizer(expanded)["input_ids"]
        spans, pos = [], 0
        for img in images:
            while ids[pos] != self.image_token_id:
                pos += 1
            if ids[pos:pos + img.num_tokens] != [self.image_token_id] * img.num_tokens:
                raise ValueError("image placeholder expansion does not match the tokenizer")
            spans.append(MMSpan(pos, img.num_tokens))
            pos += img.num_tokens
        if self.image_token_id in ids[pos:]:
            raise ValueError("unexpected image tokens after the last image")
        return PromptInputs(ids, spans)
