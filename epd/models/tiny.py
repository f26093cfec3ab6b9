"""Tiny offline checkpoints in Hugging Face layout (`epd tiny-model`).

Invariants:
- Deterministic: the same (arch, size, seed, layout) gives byte-identical files. Every
  parameter is drawn from its own generator seeded by sha256(seed, parameter name), so
  construction order does not matter.
- Loadable with ``HF_HUB_OFFLINE=1`` by AutoProcessor + AutoModelForImageTextToText.
- Sensitive: the init (unit-variance token embeddings, unit-gain linears, Kaiming convs,
  lm_head logits with std ~3; FastViT scales calibrated, see `calibrate.py`) makes greedy continuations depend on the images, their order and
  the prompt, instead of the constant output of a std-0.02 random model.
- ``layout="native"`` is what transformers 5.23 ``save_pretrained`` writes (for llava that
  is ``language_model.model.*``, ``vision_tower.embeddings.*``, ...); ``layout="hub"``
  (llava only) uses the legacy keys published for ``llava-hf/llava-1.5-7b-hf``
  (``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
  ``language_model.lm_head.*``). FastVLM has no legacy key layout in transformers, so
  ``hub`` == ``native`` there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

ARCHS = ("llava", "fastvlm")
SIZES = ("test", "bench")
LAYOUTS = ("native", "hub")

_TEXT = {
    "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "bench": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096),
}
# CLIP vision tower: image_size / patch_size squared = image tokens (CLS dropped by "default").
_CLIP = {
    "test": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 image_size=32, patch_size=8),
    "bench": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                  num_attention_heads=6, image_size=224, patch_size=14),
}
# timm FastViT (MobileCLIP "mci0" family, shrunk): total stride 32, features = 2 * embed_dims[-1].
_FASTVIT = {
    "test": dict(image_size=128, layers=[1, 1, 1, 1], embed_dims=[16, 32, 64, 128]),
    "bench": dict(image_size=512, layers=[2, 2, 4, 2], embed_dims=[64, 128, 256, 512]),
}
_FASTVIT_STRIDE = 32
_FASTVIT_MEAN, _FASTVIT_STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]
_TOKENIZER_VOCAB = 1024
_LM_HEAD_LOGIT_STD = 3.0


def _check(arch: str, size: str, layout: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def _make_config(arch: str, size: str, tok, tspec):
    from transformers import CLIPVisionConfig, FastVlmConfig, LlamaConfig, LlavaConfig, Qwen2Config
    from transformers.models.timm_wrapper import TimmWrapperConfig

    ids = dict(
        vocab_size=len(tok),
        eos_token_id=tok.convert_tokens_to_ids(tspec.eos),
        pad_token_id=tok.convert_tokens_to_ids(tspec.pad),
        bos_token_id=tok.convert_tokens_to_ids(tspec.bos) if tspec.bos else None,
        tie_word_embeddings=False,
        dtype="float32",
    )
    image_token_id = tok.convert_tokens_to_ids("<image>")
    if arch == "llava":
        v = _CLIP[size]
        n_tokens = (v["image_size"] // v["patch_size"]) ** 2
        text = LlamaConfig(**_TEXT[size], rms_norm_eps=1e-5, **ids)
        vision = CLIPVisionConfig(**v, projection_dim=v["hidden_size"], dtype="float32")
        return LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=image_token_id,
            vision_feature_select_strategy="default", vision_feature_layer=-2,
            projector_hidden_act="gelu", image_seq_length=n_tokens, tie_word_embeddings=False,
            dtype="float32",
        ), n_tokens
    f = _FASTVIT[size]
    n_tokens = (f["image_size"] // _FASTVIT_STRIDE) ** 2
    text = Qwen2Config(**_TEXT[size], rms_norm_eps=1e-6, **ids)
    vision = TimmWrapperConfig(
        architecture="fastvit_mci0", do_pooling=False, hidden_size=2 * f["embed_dims"][-1],
        model_args={"inference_mode": True, "layers": f["layers"], "embed_dims": f["embed_dims"]},
        label_names=["none"], dtype="float32",
    )
    return FastVlmConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        image_seq_length=n_tokens, projector_hidden_act="gelu", tie_word_embeddings=False,
        dtype="float32",
    ), n_tokens


def _param_generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _init_weights(model, arch: str, seed: int) -> None:
    """Seeded, name-keyed init chosen for sensitivity (see module docstring)."""
    import torch

    hidden = model.config.text_config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = _param_generator(seed, f"{arch}/{name}")
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("embed_tokens.weight"):
                std = 1.0
            elif name.endswith("lm_head.weight"):
                std = _LM_HEAD_LOGIT_STD / math.sqrt(hidden)
            elif p.ndim == 4:  # convs feed GELU/ReLU: Kaiming gain keeps FastViT features O(1)
                std = math.sqrt(2.0) / math.sqrt(max(1, p[0].numel()))
            elif p.ndim >= 2:
                std = 1.0 / math.sqrt(max(1, p[0].numel()))
            elif leaf == "bias":
                std = 0.02
            elif "norm" in name or name.endswith(("ln.weight", "bn.weight")) or leaf == "weight":
                p.fill_(1.0)  # norm scales (RMSNorm, LayerNorm, BatchNorm)
                continue
            else:  # layer scales, class embeddings, ...
                std = 0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


def _hub_key(key: str) -> str:
    for native, hub in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if key.startswith(native):
            return hub + key[len(native):]
    raise ValueError(f"unexpected llava parameter {key}")


def _make_processor(arch: str, size: str, tok, n_tokens: int):
    from transformers import CLIPImageProcessor, LlavaProcessor

    from epd.models.templates import CHATML_CHAT_TEMPLATE, LLAVA_CHAT_TEMPLATE

    if arch == "llava":
        v = _CLIP[size]
        side, patch, strategy, extra = v["image_size"], v["patch_size"], "default", 1
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
        template = LLAVA_CHAT_TEMPLATE
    else:
        side, patch, strategy, extra = _FASTVIT[size]["image_size"], _FASTVIT_STRIDE, "full", 0
        mean, std = _FASTVIT_MEAN, _FASTVIT_STD
        template = CHATML_CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        do_center_crop=True, do_normalize=True, image_mean=mean, image_std=std,
        do_convert_rgb=True, resample=3,
    )
    proc = LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=extra,
        chat_template=template,
    )
    tok.chat_template = template
    return proc


def build_tiny_checkpoint(
    arch: str, out_dir: str | Path, size: str = "test", seed: int = 0, layout: str = "native"
) -> Path:
    """Write a seeded random checkpoint of `arch` to `out_dir` (created) and return it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from epd.models.st_writer import save_aligned
    from epd.models.tokenizer_factory import CHATML_TOKENS, LLAMA_TOKENS, train_tokenizer

    _check(arch, size, layout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tspec = LLAMA_TOKENS if arch == "llava" else CHATML_TOKENS
    tok = train_tokenizer(tspec, _TOKENIZER_VOCAB)
    config, n_tokens = _make_config(arch, size, tok, tspec)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.eval()  # calibration must not update BatchNorm running stats
    _init_weights(model, arch, seed)
    if arch == "fastvlm":
        from epd.models.calibrate import calibrate_vision, calibration_batch

        side = _FASTVIT[size]["image_size"]
        calibrate_vision(model.model.vision_tower, model.model.multi_modal_projector.linear_1,
                         calibration_batch(seed, _FASTVIT_MEAN, _FASTVIT_STD),
                         calibration_batch(seed, _FASTVIT_MEAN, _FASTVIT_STD, side))
    eos = [config.text_config.eos_token_id] + [tok.convert_tokens_to_ids(t) for t in tspec.extra_eos]
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=config.text_config.pad_token_id,
    )
    model.save_pretrained(out)
    # Rewrite what save_pretrained wrote, 64-byte aligned (see st_writer), renamed for "hub".
    weights = out / "model.safetensors"
    if arch == "llava" and layout == "hub":
        state = {_hub_key(k): v.detach().clone() for k, v in model.state_dict().items()}
    else:  # clone: detach from the mmap of the file we are about to replace
        state = {k: v.clone() for k, v in load_file(str(weights)).items()}
    save_aligned(state, out / "model.safetensors.tmp")
    os.replace(out / "model.safetensors.tmp", weights)
    _make_processor(arch, size, tok, n_tokens).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "epd_tiny.json").write_text(
        json.dumps({"arch": arch, "size": size, "seed": seed, "layout": layout}, indent=2) + "\n"
    )
    return out


def _cache_root() -> Path:
    env = os.environ.get("EPD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "epd"


def default_model_dir(arch: str = "llava", size: str = "test") -> Path:
    """The tiny checkpoint for (arch, size, seed 0), built on first use; safe under races."""
    _check(arch, size, "native")
    root = _cache_root() / "models"
    final = root / f"tiny-{arch}-{size}"
    if (final / "epd_tiny.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{arch}-{size}-", dir=root))
    try:
        build_tiny_checkpoint(arch, tmp, size=size)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "epd_tiny.json").exists():  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
