"""Load only the half of a VLM checkpoint a process needs.

- ``load_language_model``: the HF text model (LlamaModel / Qwen2Model) + lm_head; the
  vision tower is never allocated.
- ``load_vision_model``: vision tower + projector; the language model is never allocated.

Checkpoint keys are mapped with transformers' own conversion mapping
(``get_model_conversion_mapping`` + ``rename_source_key``, computed on a meta-device copy
of the full model), so both the native transformers-5 layout and the legacy hub layout
(``language_model.model.*``, ``vision_tower.vision_model.*``) load. Image features come
from the HF class's own ``get_image_features`` on a model whose language model is
dropped, so they are the rows ``generate()`` places in ``inputs_embeds``.

Attention dispatch (checked against transformers 5.23): ``LanguageModel.forward`` calls
the HF base model with ``use_cache=False``; extra ``**attn_kwargs`` flow through the
decoder layers unchanged into the attention function registered under the model's
``attn_implementation`` (``transformers.AttentionInterface.register(name, fn)``; register
before loading). For a name that is not in ``masking_utils.AttentionMaskInterface``,
``create_causal_mask`` returns the given ``attention_mask`` (``None``) untouched, so a
custom paged attention receives ``attention_mask=None`` and owns causality itself; if
you register a mask function under the same name it is used instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from epd.models.processing import ImageInput

_LM_PREFIX = "model.language_model."
_HEAD_PREFIX = "lm_head."
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    return [d / "model.safetensors"]


def _meta_full_model(d: Path):
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(d))
    with torch.device("meta"), no_init_weights():
        full = AutoModelForImageTextToText.from_config(config)
    return config, full


def _load_tensors(d: Path, full, prefixes: tuple[str, ...], dtype, device) -> dict:
    """Checkpoint tensors under `prefixes` (canonical native names), renamed by transformers."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(full)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_sd = full.state_dict()
    out = {}
    for path in _weight_files(d):
        with safe_open(str(path), "pt", device="cpu") as f:
            for key in f.keys():
                name, converter = rename_source_key(
                    key, renamings, converters, full.base_model_prefix, meta_sd
                )
                if not name.startswith(prefixes):
                    continue
                if converter is not None:
                    raise NotImplementedError(f"weight {key} needs a tensor conversion")
                t = f.get_tensor(key)
                out[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return out


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


class LanguageModel(nn.Module):
    def __init__(self, model: nn.Module, lm_head: nn.Linear, config):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.config = config

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **attn_kwargs):
        out = self.model(
            inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False, **attn_kwargs
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def load_language_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> LanguageModel:
    from transformers import AutoModel
    from transformers.initialization import no_init_weights

    d = Path(model_dir)
    config, full = _meta_full_model(d)
    state = _load_tensors(d, full, (_LM_PREFIX, _HEAD_PREFIX), dtype, device)
    text_config = config.text_config
    with torch.device(device), no_init_weights():
        model = AutoModel.from_config(text_config, dtype=dtype,
                                      attn_implementation=attn_implementation)
        lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False,
                            dtype=dtype)
    model.load_state_dict(_strip(state, _LM_PREFIX), strict=True)
    if "lm_head.weight" in state:
        lm_head.weight.data.copy_(state["lm_head.weight"])
    elif config.tie_word_embeddings or text_config.tie_word_embeddings:
        lm_head.weight = model.embed_tokens.weight
    else:
        raise ValueError(f"{d}: checkpoint has no lm_head.weight and embeddings are not tied")
    return LanguageModel(model, lm_head, text_config).eval()


@dataclass
class _Batch:
    pixel_values: torch.Tensor
    extra: dict


class VisionModel(nn.Module):
    """Vision tower + projector; `encode` yields per image the rows for `inputs_embeds`."""

    def __init__(self, inner: nn.Module, config, dtype: torch.dtype, device):
        super().__init__()
        self.inner = inner  # the HF `XModel` with language_model removed
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.inner.parameters())

    def _batches(self, images: list[ImageInput]) -> list[tuple[list[int], _Batch]]:
        groups: dict[tuple, list[int]] = {}
        for i, img in enumerate(images):
            key = (tuple(img.pixel_values.shape[1:]), tuple(sorted(img.extra)))
            groups.setdefault(key, []).append(i)
        out = []
        for idx in groups.values():
            pv = torch.cat([images[i].pixel_values for i in idx]).to(self.device, self.dtype)
            extra = {k: torch.cat([images[i].extra[k] for i in idx]).to(self.device)
                     for k in images[idx[0]].extra}
            out.append((idx, _Batch(pv, extra)))
        return out

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        result: list[torch.Tensor | None] = [None] * len(images)
        for idx, batch in self._batches(images):
            feats = self.inner.get_image_features(pixel_values=batch.pixel_values,
                                                  **batch.extra).pooler_output
            for i, f in zip(idx, feats, strict=True):
                f = f.reshape(-1, f.shape[-1])
                if f.shape[0] != images[i].num_tokens:
                    raise ValueError(f"image {i}: {f.shape[0]} feature rows, "
                                     f"expected {images[i].num_tokens}")
                result[i] = f
        return result  # type: ignore[return-value]


def load_vision_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> VisionModel:
    from transformers import AutoModel
    from transformers.initialization import no_init_weights

    d = Path(model_dir)
    config, full = _meta_full_model(d)
    state = _load_tensors(d, full, _VISION_PREFIXES, dtype, device)
    inner = full.model  # meta: only its module structure and HF methods are used
    projector_cls = type(inner.multi_modal_projector)
    with torch.device(device), no_init_weights():
        inner.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
        inner.multi_modal_projector = projector_cls(config).to(dtype)
    inner.language_model = None
    inner.vision_tower.load_state_dict(_strip(state, "model.vision_tower."), strict=True)
    inner.multi_modal_projector.load_state_dict(
        _strip(state, "model.multi_modal_projector."), strict=True
    )
    return VisionModel(inner.eval(), config, dtype, device).eval()
