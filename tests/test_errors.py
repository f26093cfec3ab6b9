"""epd.errors: exact OpenAI error JSON through a real FastAPI app (TestClient)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from epd.errors import (
    EPDError,
    error_body,
    format_loc,
    install_error_handlers,
    invalid_request,
    not_found,
    service_unavailable,
    upstream_error,
)
from epd.protocol import ChatCompletionRequest, CompletionRequest


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict:
        return {"model": req.model, "images": req.num_images}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        return {"prompt": req.prompt}

    @app.get("/raise/{kind}")
    async def boom(kind: str) -> dict:
        if kind == "busy":
            raise service_unavailable("all encoders are busy", retry_after_s=1.5)
        if kind == "model":
            raise not_found("The model 'x' does not exist")
        if kind == "upstream":
            raise upstream_error("encoder enc-0 died during the transfer", "epd_migration_failed")
        raise RuntimeError("secret internal detail /etc/shadow")

    return app


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


def user(content) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_valid_request_passes(client):
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
    resp = client.post("/v1/chat/completions", json=user([image, {"type": "text", "text": "hi"}]))
    assert resp.status_code == 200 and resp.json() == {"model": "m", "images": 1}


def test_error_body_exact():
    err = invalid_request("bad", "temperature", "invalid_value")
    assert error_body(err) == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    assert err.status == 400 and err.headers is None


def test_epd_errors_render_with_status_and_headers(client):
    resp = client.get("/raise/busy")
    assert error(resp, 503) == {
        "message": "all encoders are busy",
        "type": "service_unavailable",
        "param": None,
        "code": "service_unavailable",
    }
    assert resp.headers["retry-after"] == "2"
    assert error(client.get("/raise/model"), 404) == {
        "message": "The model 'x' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert error(client.get("/raise/upstream"), 502) == {
        "message": "encoder enc-0 died during the transfer",
        "type": "upstream_error",
        "param": None,
        "code": "epd_migration_failed",
    }


def test_unhandled_exception_is_500_without_leak(client, caplog):
    with caplog.at_level(logging.ERROR, logger="epd.errors"):
        resp = client.get("/raise/crash")
    err = error(resp, 500)
    assert err["type"] == "internal_error" and err["param"] is None
    assert "secret" not in resp.text and "Traceback" not in resp.text
    assert any("secret internal detail" in r.getMessage() or r.exc_info for r in caplog.records)


def test_malformed_json(client):
    resp = client.post(
        "/v1/chat/completions",
        content=b'{"model": "m", "messages": [',
        headers={"content-type": "application/json"},
    )
    err = error(resp, 400)
    assert err["param"] is None and err["type"] == "invalid_request_error"
    assert err["message"].startswith("The request body is not valid JSON")


def test_missing_body_and_wrong_body_type(client):
    err = error(client.post("/v1/chat/completions"), 400)
    assert err["param"] is None and "missing" in err["message"].lower()
    err = error(client.post("/v1/chat/completions", json=[1, 2]), 400)
    assert err["param"] is None and err["message"] == "The request body must be a JSON object."


@pytest.mark.parametrize(
    "body,param,needle,code",
    [
        (
            {"messages": [{"role": "user", "content": "x"}]},
            "model",
            "Missing required parameter: 'model'",
            "missing_required_parameter",
        ),
        (user("x") | {"temperature": 2.5}, "temperature", "less than or equal to 2", None),
        (user("x") | {"temperature": "hot"}, "temperature", "valid number", None),
        (user("x") | {"top_p": 0}, "top_p", "greater than 0", None),
        (user("x") | {"max_tokens": 0}, "max_tokens", "greater than or equal to 1", None),
        (user("x") | {"top_logprobs": 2}, "top_logprobs", "requires logprobs", None),
        (
            user("x") | {"presence_penalty": 0.5},
            "presence_penalty",
            "not supported",
            "unsupported_value",
        ),
        (
            user("x") | {"tools": [{"type": "function"}]},
            "tools",
            "not supported",
            "unsupported_parameter",
        ),
        (
            user("x") | {"response_format": {"type": "json_object"}},
            "response_format",
            "text",
            "unsupported_value",
        ),
        (user("x") | {"stop": ["a", 3]}, "stop[1]", "valid string", None),
        (
            user([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]),
            "messages[0].content[1].image_url.url",
            "Missing required parameter",
            "missing_required_parameter",
        ),
        (
            user([{"type": "text", "text": "a"}, {"type": "image_url"}]),
            "messages[0].content[1].image_url",
            "Missing required parameter",
            "missing_required_parameter",
        ),
        (
            user([{"type": "text", "text": "a"}, {"type": "input_audio"}]),
            "messages[0].content[1]",
            "'text' and 'image_url'",
            None,
        ),
        (user(5), "messages[0].content", "string or a list of content parts", None),
        ({"model": "m", "messages": []}, "messages", "at least 1 item", None),
        (
            {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "'user'",
            None,
        ),
    ],
)
def test_validation_errors_name_the_param(client, body, param, needle, code):
    err = error(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param
    assert needle in err["message"], err["message"]
    assert err["code"] == code and err["type"] == "invalid_request_error"


def test_completions_validation(client):
    err = error(client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]}), 400)
    assert err["param"] == "prompt" and "batched" in err["message"]
    err = error(
        client.post("/v1/completions", json={"model": "m", "prompt": "a", "echo": True}), 400
    )
    assert err["param"] == "echo" and err["code"] == "unsupported_value"
    err = error(client.post("/v1/completions", json={"model": "m", "prompt": [1, -1]}), 400)
    assert err["param"] == "prompt[1]"
    ok = client.post("/v1/completions", json={"model": "m", "prompt": [[5, 6]]})
    assert ok.status_code == 200 and ok.json() == {"prompt": [5, 6]}


def test_unknown_route_and_method(client):
    err = error(client.get("/v1/nope"), 404)
    assert err["message"] == "Not Found" and err["code"] == "not_found"
    err = error(client.get("/v1/chat/completions"), 405)
    assert err["code"] == "method_not_allowed"


def test_several_errors_are_counted(client):
    err = error(
        client.post("/v1/chat/completions", json=user("x") | {"temperature": 9, "top_p": 9}), 400
    )
    assert err["param"] == "temperature" and "(1 more invalid parameter)" in err["message"]


def test_format_loc():
    assert format_loc(("body", "messages", 0, "content", "Parts", 1, "ImagePart", "image_url")) == (
        "messages[0].content[1].image_url"
    )
    assert format_loc(("stop", "list[str]", 2)) == "stop[2]"
    assert format_loc(("body",)) is None
    assert isinstance(EPDError("x"), Exception) and EPDError("x").status == 400
