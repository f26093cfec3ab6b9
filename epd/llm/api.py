"""Offline API: `LLM(model_dir).generate(conversations)` runs everything batched.

Chat messages are OpenAI-style; image parts may be data URLs or local file paths (the
offline caller owns the machine, so any local path is allowed). Vision runs locally.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence as Seq
from pathlib import Path

from epd.llm.config import EngineConfig
from epd.llm.engine import LLMEngine
from epd.llm.outputs import GenerationOutput
from epd.llm.sampling_params import SamplingParams
from epd.llm.sequence import MMItem


class LLM:
    def __init__(self, model_dir: str | Path, **config_overrides) -> None:
        from epd.encoder.media import MediaConfig

        config_overrides.setdefault("vision", "local")
        self.config = EngineConfig(model_dir=model_dir, **config_overrides)
        self.engine = LLMEngine(self.config)
        self.processor = self.engine.processor
        self.media = MediaConfig(allowed_local_media_path="/")

    def generate(
        self, conversations: list[list[dict]] | list[dict], sampling: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        """One output per conversation (a single conversation may be passed bare)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        requests = [self._chat_request(c) for c in conversations]
        return self._run(requests, sampling, "messages")

    def generate_prompts(
        self, prompts: list[str | list[int]], sampling: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        tok = self.processor.tokenizer
        requests = [
            (list(p) if not isinstance(p, str) else tok.encode(p, add_special_tokens=False), [])
            for p in prompts
        ]
        return self._run(requests, sampling, "prompt")

    def _chat_request(self, messages: list[dict]) -> tuple[list[int], list[MMItem]]:
        from epd.encoder.media import ImageRef, collect_image_parts, load_image_sync

        refs = collect_image_parts(messages, limit=self.media.limit_images_per_request)
        pil = []
        for ref in refs:
            url = ref.url
            if "://" not in url and not url.startswith("data:") and not os.path.isabs(url):
                url = os.path.abspath(url)
            pil.append(load_image_sync(ImageRef(url, ref.param), self.media))
        images = self.processor.preprocess_images(pil) if pil else []
        prompt = self.processor.tokenize(self.processor.render(messages), images)
        items = [
            MMItem(span.offset, span.length, img.mm_hash, image=img)
            for span, img in zip(prompt.mm_spans, images, strict=True)
        ]
        return prompt.token_ids, items

    def _run(
        self, requests: Seq[tuple[list[int], list[MMItem]]], sampling: SamplingParams | None,
        prompt_param: str,
    ) -> list[GenerationOutput]:
        sampling = sampling or SamplingParams()
        ids = [f"offline-{uuid.uuid4().hex}" for _ in requests]
        # Validate everything before adding anything: a bad request adds nothing.
        seqs = {
            rid: self.engine.make_sequence(rid, tokens, sampling, items, prompt_param)
            for rid, (tokens, items) in zip(ids, requests, strict=True)
        }
        for seq in seqs.values():
            self.engine.add_sequence(seq)
        while self.engine.has_unfinished():
            self.engine.step()
        return [
            GenerationOutput(
                token_ids=list(seqs[rid].output_token_ids),
                text=seqs[rid].text,
                finish_reason=str(seqs[rid].finish_reason),
                num_prompt_tokens=seqs[rid].num_prompt_tokens,
                num_cached_tokens=seqs[rid].num_cached_tokens,
                logprobs=list(seqs[rid].logprobs),
            )
            for rid in ids
        ]
