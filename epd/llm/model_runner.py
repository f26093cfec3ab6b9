"""Runs the language model on a packed batch over the paged KV cache.

Invariants: one forward per step over all scheduled tokens packed as batch size 1 with
explicit position ids; attention metadata is built once per step; image feature rows are
spliced into the input embeddings at their placeholder positions, also when a prefill
chunk starts or ends inside an image span; logits are computed only for the last token
of each sequence that samples this step (a finished prefill, or a decode).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from epd.llm.attention import ATTN_IMPLEMENTATION, BatchEntry, build_attention_metadata, get_backend
from epd.llm.config import CacheLayout, EngineConfig
from epd.llm.kv_cache import PagedKVCache, num_blocks_for_budget
from epd.llm.positions import packed_positions
from epd.llm.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

FEATURE_CACHE_ENTRIES = 64


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from epd.models import load_language_model, load_spec, load_vision_model

        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = getattr(torch, config.resolved_dtype())
        self.spec = load_spec(config.model_dir)
        self.lm = load_language_model(
            config.model_dir,
            dtype=self.dtype,
            device=self.device,
            attn_implementation=ATTN_IMPLEMENTATION,
        )
        self.vision = None
        # Encoder cache: recently computed image features by mm_hash (LRU).
        self._feature_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        if config.vision == "local":
            self.vision = load_vision_model(config.model_dir, dtype=self.dtype, device=self.device)
        self.layout = self._cache_layout()
        self.kv_cache = PagedKVCache(self.layout, self.device)
        self.backend = get_backend(config.resolved_attention_backend())
        logger.info("KV cache layout: %s (%.1f MiB)", self.layout.as_dict(),
                    self.layout.total_nbytes / 2**20)

    def _cache_layout(self) -> CacheLayout:
        spec, cfg = self.spec, self.config
        model_len = spec.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > model_len:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} exceeds the model's {model_len} positions"
            )
        layout = CacheLayout(
            num_blocks=cfg.num_blocks or 1,
            block_size=cfg.block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=cfg.max_model_len or model_len,
        )
        if cfg.num_blocks is None:
            n = num_blocks_for_budget(cfg.kv_cache_memory_bytes, layout.block_nbytes)
            # More blocks than max_num_seqs full-length sequences need would be wasted.
            n = min(n, cfg.max_num_seqs * -(-layout.max_model_len // cfg.block_size))
            layout = CacheLayout(**{**layout.__dict__, "num_blocks": n})
        return layout

    # -- per step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq], block_table: Callable[[str], list[int]]
    ) -> torch.Tensor | None:
        """Forward the packed batch; logits [num_sampling, vocab] in scheduled order."""
        if not scheduled:
            return None
        ids: list[int] = []
        for s in scheduled:
            c = s.seq.num_computed_tokens
            ids.extend(s.seq.token_ids[c : c + s.num_new_tokens])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = self.lm.embed(input_ids.unsqueeze(0))
        self._splice_images(scheduled, embeds[0])
        chunks = [(s.seq.num_computed_tokens, s.num_new_tokens) for s in scheduled]
        positions = packed_positions(chunks, self.device)
        entries = [
            BatchEntry(block_table(s.seq.request_id), s.seq.num_computed_tokens, s.num_new_tokens)
            for s in scheduled
        ]
        meta = build_attention_metadata(
            entries, self.layout.block_size, self.kv_cache, self.backend, self.device
        )
        hidden = self.lm.forward(embeds, positions, epd_attn_metadata=meta)
        last, ends = [], 0
        for s in scheduled:
            ends += s.num_new_tokens
            if s.samples:
                last.append(ends - 1)
        if not last:
            return None
        rows = hidden[0, torch.tensor(last, device=self.device)]
        return self.lm.logits(rows).float()

    def _splice_images(self, scheduled: list[ScheduledSeq], embeds: torch.Tensor) -> None:
        """Overwrite placeholder rows with image features for every overlapping span."""
        spans = []
        packed_start = 0
        for s in scheduled:
            lo = s.seq.num_computed_tokens
            hi = lo + s.num_new_tokens
            for item in s.seq.mm_items:
                a, b = max(lo, item.offset), min(hi, item.end)
                if a < b:
                    spans.append((item, packed_start + a - lo, a - item.offset, b - a))
            packed_start += s.num_new_tokens
        if not spans:
            return
        self._encode_missing([item for item, *_ in spans])
        for item, dst, src, n in spans:
            embeds[dst : dst + n] = item.features[src : src + n].to(embeds.dtype)

    def _encode_missing(self, items) -> None:
        """Features for items that lack them: from the encoder cache (by mm_hash), else
        one batched vision forward over the distinct missing images."""
        todo: dict[str, list] = {}
        for item in items:
            if item.features is not None:
                continue
            cached = self._feature_cache.get(item.mm_hash)
            if cached is not None:
                self._feature_cache.move_to_end(item.mm_hash)
                item.features = cached
            else:
                todo.setdefault(item.mm_hash, []).append(item)
        if not todo:
            return
        firsts = [group[0] for group in todo.values()]
        if self.vision is None or any(item.image is None for item in firsts):
            raise RuntimeError("image features missing and no local vision model to compute them")
        feats = self.vision.encode([item.image for item in firsts])
        for group, f in zip(todo.values(), feats, strict=True):
            f = f.to(device=self.device, dtype=self.dtype)
            for item in group:
                if f.shape[0] != item.length:
                    raise ValueError(
                        f"image {item.mm_hash[:12]} has {f.shape[0]} feature rows, "
                        f"its placeholder span has {item.length}"
                    )
                item.features = f
            self._feature_cache[group[0].mm_hash] = f
            while len(self._feature_cache) > FEATURE_CACHE_ENTRIES:
                self._feature_cache.popitem(last=False)
