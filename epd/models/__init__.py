"""Model families: tiny offline checkpoints, the reference oracle, loaders, prompt processing.

Imports are lazy so that `import epd.models` does not import torch/transformers.
"""

from __future__ import annotations

_EXPORTS = {
    "build_tiny_checkpoint": "epd.models.tiny",
    "default_model_dir": "epd.models.tiny",
    "ReferenceOutput": "epd.models.reference",
    "reference_generate": "epd.models.reference",
    "reference_generate_text": "epd.models.reference",
    "reference_image_features": "epd.models.reference",
    "ModelSpec": "epd.models.spec",
    "load_spec": "epd.models.spec",
    "LanguageModel": "epd.models.loader",
    "VisionModel": "epd.models.loader",
    "load_language_model": "epd.models.loader",
    "load_vision_model": "epd.models.loader",
    "ImageInput": "epd.models.processing",
    "ImagePart": "epd.models.processing",
    "MMSpan": "epd.models.processing",
    "MultimodalProcessor": "epd.models.processing",
    "PromptInputs": "epd.models.processing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
