"""Checking a `migration_request` against this decode engine, before anything is allocated.

Never trust it blindly: it names block ids in another process's memory. Checked here (400
naming `migration_request.<field>`): the KV layout (block size, dtype, layers, kv heads,
head dim) equals ours, the transfer backend is ours, the prompt the prefill computed is
the prompt of this request (token ids and image spans), the first token is in the
vocabulary. Block ids against the prefill's pool size and the pool's real layout are
checked once the handshake has told us (`PDMigrations._pool_check`, the migrator's range
check).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from epd.errors import invalid_request
from epd.llm.pd.producer import kv_layout_of
from epd.protocol import kv_layout_mismatch

P = "migration_request"


def check_migration(mr: Any, prompt_ids: list[int], mm_items: list[Any], *, layout: Any,
                    vocab_size: int, backend: str | None) -> None:
    """Raise EPDError(400) naming the first field of `mr` this engine cannot accept."""
    mine = kv_layout_of(layout)
    diff = kv_layout_mismatch(mine, mr.kv_layout)
    if diff is None and "block_nbytes" in mr.kv_layout:
        if mr.kv_layout["block_nbytes"] != mine["block_nbytes"]:
            diff = (f"kv_layout.block_nbytes: expected {mine['block_nbytes']!r}, got "
                    f"{mr.kv_layout['block_nbytes']!r}")
    if diff is not None:
        raise invalid_request(
            f"the prefill engine's KV layout differs from this decode engine's ({diff}); start "
            "both with the same model, --dtype and --block-size", f"{P}.kv_layout",
            "kv_layout_mismatch")
    if backend is not None and mr.transfer_backend != backend:
        raise invalid_request(
            f"the prefill engine uses transfer backend {mr.transfer_backend!r}, this engine "
            f"{backend!r} (start both with the same --transfer)", f"{P}.transfer_backend",
            "transfer_backend_mismatch")
    if mr.num_tokens != len(prompt_ids):
        raise invalid_request(
            f"the prefill computed {mr.num_tokens} prompt tokens, this request's prompt has "
            f"{len(prompt_ids)}: send the same body to both engines", f"{P}.num_tokens",
            "migration_request_mismatch")
    if mr.prompt_token_ids is not None and list(mr.prompt_token_ids) != list(prompt_ids):
        raise invalid_request(
            "the prefill computed another prompt than this request's: send the same body to "
            "both engines", f"{P}.prompt_token_ids", "migration_request_mismatch")
    spans = [(m.offset, m.length) for m in mm_items]
    if spans != [(s.offset, s.length) for s in mr.mm_spans]:
        raise invalid_request(
            "the prefill's image spans differ from this request's images", f"{P}.mm_spans",
            "migration_request_mismatch")
    if not 0 <= mr.first_token < vocab_size:
        raise invalid_request(f"first_token must be in [0, {vocab_size})", f"{P}.first_token")


def decode_prompt(processor: Any, messages: list[dict], mr: Any) -> tuple[list[int], list]:
    """The chat prompt's token ids with each image placeholder expanded to the length of
    the prefill's span, and one feature-less `MMItem` per image (keyed by the prefill's
    mm_hash): the decode engine never loads images. Raises ValueError when the messages'
    images and the spans disagree."""
    from epd.llm.sequence import MMItem

    counts = [SimpleNamespace(num_tokens=s.length) for s in mr.mm_spans]
    prompt = processor.tokenize(processor.render(messages), counts)
    if len(prompt.mm_spans) != len(mr.mm_spans):
        raise ValueError(f"the messages have {len(prompt.mm_spans)} images, the prefill "
                         f"{len(mr.mm_spans)}")
    items = [MMItem(offset=span.offset, length=span.length, mm_hash=ref.mm_hash)
             for span, ref in zip(prompt.mm_spans, mr.mm_spans, strict=True)]
    return list(prompt.token_ids), items
