"""`ModelSpec`: the facts about a checkpoint the engine sizes itself by.

Read from ``config.json`` (+ ``generation_config.json`` for stop ids) without building
any model. ``eos_token_ids`` is what greedy ``generate()`` stops on: the generation
config's ``eos_token_id`` (int or list) if present, else the text config's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_ARCH_BY_MODEL_TYPE = {"llava": "llava", "fast_vlm": "fastvlm"}


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llava" | "fastvlm"
    model_type: str  # HF model_type of the checkpoint
    image_token_id: int
    image_seq_length: int  # tokens per image at the processor's native resolution
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: torch.dtype

    @property
    def bos(self) -> int | None:
        return self.bos_token_id


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype(name: str | None) -> torch.dtype:
    dt = getattr(torch, str(name or "float32").replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in config.json")
    return dt


def load_spec(model_dir: str | Path) -> ModelSpec:
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    model_type = cfg.get("model_type", "")
    if model_type not in _ARCH_BY_MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r} in {d}/config.json")
    text = cfg["text_config"]
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = _as_ids(gen.get("eos_token_id")) or _as_ids(text.get("eos_token_id"))
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    return ModelSpec(
        arch=_ARCH_BY_MODEL_TYPE[model_type],
        model_type=model_type,
        image_token_id=int(image_token),
        image_seq_length=int(cfg.get("image_seq_length", 0)),
        hidden_size=hidden,
        num_layers=int(text["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text["max_position_embeddings"]),
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", text.get("bos_token_id")),
        pad_token_id=gen.get("pad_token_id", text.get("pad_token_id")),
        dtype=_dtype(cfg.get("dtype") or text.get("dtype") or cfg.get("torch_dtype")),
    )
