"""Package surfaces that other modules import: epd.protocol re-exports, epd.transfer lazy
exports, and that importing either stays cheap (no transfer stack, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import epd.protocol as p
import epd.transfer as tr

# Every public name the single-file epd/protocol.py exported before it became a package.
PROTOCOL_NAMES = """
DTYPES KV_LAYOUT_KEYS SSE_DONE Ack AckAddress HttpBaseURL TextPart ImageURL ImagePart
ContentPart Content Message ImageFeatureRef EncoderResult EncodeRequest EncodeResponse
ReleaseRequest ReleaseResponse MigrationRequest MMSpanRef kv_layout_mismatch StreamOptions
ChatCompletionRequest PromptInput CompletionRequest FinishReason new_id PromptTokensDetails
Usage TopLogprob TokenLogprob ChoiceLogprobs ChatCompletionMessage ChatCompletionChoice
ChatCompletionResponse DeltaMessage ChatChunkChoice ChatCompletionChunk CompletionLogprobs
CompletionChoice CompletionResponse CompletionChunk PrefillResponse ModelCard ModelList
chat_chunk chat_usage_chunk completion_chunk sse
""".split()

TRANSFER_LAZY = {
    "available_backends": "epd.transfer.registry",
    "create_transfer_engine": "epd.transfer.registry",
    "AckListener": "epd.transfer.acks",
    "AckSender": "epd.transfer.acks",
    "DROP_ACKS_ENV": "epd.transfer.acks",
    "CONNECT_PATH": "epd.transfer.http",
    "http_handshake": "epd.transfer.http",
    "make_transfer_router": "epd.transfer.http",
}


def test_protocol_reexports_every_public_name():
    assert sorted(p.__all__) == sorted(PROTOCOL_NAMES)
    for name in PROTOCOL_NAMES:
        obj = getattr(p, name)
        module = getattr(obj, "__module__", None)
        if isinstance(obj, type) and name != "Ack":
            assert module is not None and module.startswith("epd.protocol."), (name, module)
    from epd.protocol import EncoderResult, PrefillResponse, Usage, sse
    from epd.protocol.responses import Usage as U
    from epd.protocol.wire import EncoderResult as ER
    from epd.protocol.wire import PrefillResponse as PR

    assert (EncoderResult, PrefillResponse, Usage) == (ER, PR, U)
    assert sse({"a": 1}) == 'data: {"a":1}\n\n'


def test_protocol_unknown_name_is_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = p.NoSuchThing


def test_transfer_lazy_exports_resolve_to_their_modules():
    import importlib

    for name, module in TRANSFER_LAZY.items():
        assert name in tr.__all__ and name in dir(tr)
        assert getattr(tr, name) is getattr(importlib.import_module(module), name)
    from epd.transfer import AckListener, http_handshake

    assert AckListener.__name__ == "AckListener" and callable(http_handshake)
    with pytest.raises(AttributeError, match="nope"):
        _ = tr.nope


def test_importing_protocol_and_transfer_is_cheap():
    code = (
        "import sys, json; import epd.protocol, epd.transfer; "
        "print(json.dumps(sorted(m for m in ('zmq', 'dlslime', 'fastapi', 'httpx', 'torch') "
        "if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []
