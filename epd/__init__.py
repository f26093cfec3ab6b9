"""epd: an Encode-Prefill-Decode disaggregated serving engine for vision-language models."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import epd` (e.g. for the CLI) does not import torch.
    if name == "LLM":
        from epd.llm.api import LLM

        return LLM
    if name == "SamplingParams":
        from epd.llm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
