"""epd.protocol: request validation, response shapes, SSE helpers and the EPD wire types."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from epd import protocol as p
from epd.errors import from_validation_errors


def feature_ref(**over) -> dict:
    ref = {
        "mm_hash": "ab" * 32,
        "num_tokens": 10,
        "block_ids": [3, 7, 8],
        "block_tokens": 4,
        "dtype": "bfloat16",
        "hidden_size": 64,
        "lease_id": "lease-1",
        "lease_expires_at": 1.7e9,
    }
    return ref | over


def encoder_result(**over) -> dict:
    res = {
        "encoder_id": "enc-0",
        "encoder_url": "http://127.0.0.1:8100/",
        "transfer_backend": "tcp",
        "pool_name": "mm",
        "ack_address": "tcp://127.0.0.1:8101",
        "images": [feature_ref()],
    }
    return res | over


def migration(**over) -> dict:
    layout = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float32",
        "block_size": 16,
    }
    mig = {
        "engine_id": "prefill-0",
        "engine_url": "http://127.0.0.1:8200",
        "transfer_backend": "tcp",
        "pool_name": "kv",
        "ack_address": "tcp://[::1]:8201",
        "lease_id": "kv-lease-9",
        "block_ids": [0, 5],
        "block_size": 16,
        "num_tokens": 20,
        "first_token": 42,
        "kv_layout": layout,
    }
    return mig | over


IMAGE_MSG = {
    "role": "user",
    "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/a.png", "detail": "low"}},
    ],
}


def param_of(exc: ValidationError) -> str | None:
    return from_validation_errors(exc.errors()).param


def test_chat_request_normalization_and_unknown_fields_ignored():
    req = p.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": "be short"}, IMAGE_MSG],
            "max_tokens": 50,
            "max_completion_tokens": 7,
            "stop": "\n",
            "n": None,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 3,
            "top_k": -1,
            "parallel_tool_calls": True,
            "some_future_field": {"x": 1},
        }
    )
    assert req.num_images == 1 and req.include_usage
    assert isinstance(req.messages[1].content[1], p.ImagePart)
    assert req.messages[1].content[1].image_url.detail == "low"
    assert req.sampling_options() == {
        "max_tokens": 7,
        "temperature": None,
        "top_p": None,
        "top_k": -1,
        "seed": None,
        "stop": ["\n"],
        "stop_token_ids": [],
        "ignore_eos": False,
        "n": 1,
        "logprobs": 3,
    }
    assert not hasattr(req, "some_future_field")
    plain = p.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert plain.logprobs_count is None and plain.max_new_tokens is None and not plain.include_usage


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": ""}, "stop"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stop_token_ids": [-3]}, "stop_token_ids[0]"),
        (
            {"encoder_result": encoder_result(images=[feature_ref(), feature_ref()])},
            "encoder_result",
        ),
        (
            {"encoder_result": encoder_result(ack_address="127.0.0.1:1")},
            "encoder_result.ack_address",
        ),
        ({"prefill_only": True, "migration_request": migration()}, "prefill_only"),
    ],
)
def test_chat_request_rejections_name_param(extra, param):
    body = {"model": "m", "messages": [IMAGE_MSG]} | extra
    with pytest.raises(ValidationError) as info:
        p.ChatCompletionRequest.model_validate(body)
    assert param_of(info.value) == param


def test_zero_penalties_and_text_response_format_accepted():
    req = p.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "none",
        }
    )
    assert req.presence_penalty == 0


def test_chat_request_with_epd_extensions_roundtrips():
    body = {"model": "m", "messages": [IMAGE_MSG], "encoder_result": encoder_result()}
    req = p.ChatCompletionRequest.model_validate(body)
    assert req.encoder_result.encoder_url == "http://127.0.0.1:8100"  # trailing / stripped
    assert req.encoder_result.lease_ids == ["lease-1"]
    again = p.ChatCompletionRequest.model_validate_json(req.model_dump_json())
    assert again == req
    pd = p.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "migration_request": migration(),
        }
    )
    assert (
        pd.migration_request.first_token == 42 and pd.migration_request.first_token_logprob is None
    )


def test_completion_request_forms():
    assert p.CompletionRequest(model="m", prompt="hi").prompt == "hi"
    assert p.CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    req = p.CompletionRequest.model_validate(
        {"model": "m", "prompt": [1, 2], "logprobs": 2, "best_of": 1}
    )
    assert req.prompt == [1, 2] and req.sampling_options()["logprobs"] == 2
    for bad, param in [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(ValidationError) as info:
            p.CompletionRequest.model_validate({"model": "m"} | bad)
        assert param_of(info.value) == param, bad


def test_image_feature_ref_and_encoder_result_validation():
    ref = p.ImageFeatureRef.model_validate(feature_ref(grid_thw=[1, 4, 4]))
    assert ref.grid_thw == [1, 4, 4]
    for bad, param in [
        (feature_ref(block_ids=[1, 2]), "block_ids"),  # 10 tokens / 4 per block need 3
        (feature_ref(num_tokens=0), "num_tokens"),
        (feature_ref(dtype="int8"), "dtype"),
        (feature_ref(grid_thw=[1, 2]), "grid_thw"),
        (feature_ref(lease_id=""), "lease_id"),
    ]:
        with pytest.raises(ValidationError) as info:
            p.ImageFeatureRef.model_validate(bad)
        assert param_of(info.value) == param
    for bad, param in [
        (encoder_result(images=[]), "images"),
        (encoder_result(encoder_url="127.0.0.1:8100"), "encoder_url"),
        (encoder_result(ack_address="tcp://host:99999"), "ack_address"),
        (encoder_result(images=[feature_ref(block_ids=[1])]), "images[0].block_ids"),
    ]:
        with pytest.raises(ValidationError) as info:
            p.EncoderResult.model_validate(bad)
        assert param_of(info.value) == param


def test_encode_release_messages():
    enc = p.EncodeRequest.model_validate({"content": IMAGE_MSG["content"], "extra": 1})
    assert [part.type for part in enc.content] == ["text", "image_url"]
    resp = p.EncodeResponse(encoder_result=p.EncoderResult.model_validate(encoder_result()))
    assert p.EncodeResponse.model_validate_json(resp.model_dump_json()) == resp
    with pytest.raises(ValidationError):
        p.ReleaseRequest(lease_ids=[])
    assert p.ReleaseRequest(lease_ids=["a"]).lease_ids == ["a"]


def test_migration_request_validation_and_layout_mismatch():
    mig = p.MigrationRequest.model_validate(migration(first_token_logprob=-0.25))
    assert json.loads(mig.model_dump_json())["kv_layout"]["head_dim"] == 8
    for bad, param in [
        (migration(block_ids=[0]), "block_ids"),
        (migration(block_size=8, block_ids=[0, 1, 2]), "block_size"),
        (migration(kv_layout={"num_layers": 2}), "kv_layout"),
        (migration(kv_layout=migration()["kv_layout"] | {"head_dim": 0}), "kv_layout"),
        (migration(kv_layout=migration()["kv_layout"] | {"dtype": "int4"}), "kv_layout"),
        (migration(first_token=-1), "first_token"),
        (migration(engine_url="ftp://x"), "engine_url"),
    ]:
        with pytest.raises(ValidationError) as info:
            p.MigrationRequest.model_validate(bad)
        assert param_of(info.value) == param, bad
    mine = dict(mig.kv_layout)
    assert p.kv_layout_mismatch(mine, mig.kv_layout) is None
    assert p.kv_layout_mismatch(mine | {"num_kv_heads": 4}, mig.kv_layout) == (
        "kv_layout.num_kv_heads: expected 4, got 2"
    )
    pre = p.PrefillResponse(id="chatcmpl-1", migration_request=mig, usage=p.Usage.of(20, 1))
    assert p.PrefillResponse.model_validate_json(pre.model_dump_json()) == pre


def test_responses_have_openai_shape():
    resp = p.ChatCompletionResponse(
        model="m",
        choices=[
            p.ChatCompletionChoice(
                message=p.ChatCompletionMessage(content="a cat"),
                finish_reason="stop",
                logprobs=p.ChoiceLogprobs(
                    content=[
                        p.TokenLogprob(
                            token="a",
                            logprob=-0.1,
                            bytes=[97],
                            top_logprobs=[p.TopLogprob(token="a", logprob=-0.1, bytes=[97])],
                        )
                    ]
                ),
            )
        ],
        usage=p.Usage.of(12, 2, cached_tokens=8),
    )
    data = json.loads(resp.model_dump_json())
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "a cat"}
    assert data["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["bytes"] == [97]
    assert data["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 2,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    cmpl = p.CompletionResponse(
        model="m", choices=[p.CompletionChoice(text="x", finish_reason="length")]
    )
    assert cmpl.object == "text_completion" and cmpl.id.startswith("cmpl-")
    models = p.ModelList(data=[p.ModelCard(id="llava", max_model_len=4096)])
    dumped = json.loads(models.model_dump_json())
    assert dumped["object"] == "list" and dumped["data"][0]["object"] == "model"


def test_chunks_and_sse():
    first = p.chat_chunk("chatcmpl-1", "m", role="assistant", content="", created=5)
    assert p.sse(first) == "data: " + first.model_dump_json() + "\n\n"
    decoded = json.loads(p.sse(first)[len("data: ") : -2])
    assert decoded["object"] == "chat.completion.chunk" and decoded["created"] == 5
    assert decoded["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    last = p.chat_chunk("chatcmpl-1", "m", content="!", finish_reason="length")
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.role is None
    usage = p.chat_usage_chunk("chatcmpl-1", "m", p.Usage.of(3, 4))
    assert usage.choices == [] and usage.usage.total_tokens == 7
    c = p.completion_chunk("cmpl-1", "m", text="hi", index=1)
    assert c.choices[0].index == 1 and c.choices[0].text == "hi"
    assert p.completion_chunk("cmpl-1", "m", usage=p.Usage.of(1, 1)).choices == []
    assert p.sse({"error": {"message": "é"}}) == 'data: {"error":{"message":"é"}}\n\n'
    assert p.SSE_DONE == "data: [DONE]\n\n"
    # Our chunks parse with the official client's types.
    from openai.types.chat import ChatCompletionChunk

    ChatCompletionChunk.model_validate(decoded)


def test_ack_reexported_from_transfer():
    from epd.transfer.messages import Ack

    assert p.Ack is Ack
    with pytest.raises(AttributeError):
        _ = p.NoSuchThing
