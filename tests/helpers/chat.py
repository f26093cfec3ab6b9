"""Chat messages over the example images, and the reference replies they must produce."""

from __future__ import annotations

import base64
import functools
import threading
import time

from epd.models.reference import reference_generate

from . import EXAMPLE_IMAGES

MAX_TOKENS = 8
DEFAULT_TEXT = "What is in the picture?"
MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}


@functools.cache
def data_url(name: str) -> str:
    raw = (EXAMPLE_IMAGES / name).read_bytes()
    return f"data:{MIME[name.rsplit('.', 1)[1]]};base64,{base64.b64encode(raw).decode()}"


def image_url(name: str) -> str:
    """`cat.png` -> a data URL; `file:cat.png` -> the file's path (allow-listed by the server)."""
    if name.startswith("file:"):
        return str(EXAMPLE_IMAGES / name.removeprefix("file:"))
    return data_url(name)


def messages(images: tuple[str, ...], text: str = DEFAULT_TEXT) -> list[dict]:
    if not images:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": image_url(n)}} for n in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


_REF_LOCK = threading.Lock()


@functools.cache
def _reference(model_dir: str, images: tuple[str, ...], text: str, max_tokens: int) -> str:
    return reference_generate(model_dir, messages(images, text), max_tokens).text


def reference(
    model_dir, images: tuple[str, ...], text: str = DEFAULT_TEXT, max_tokens: int = MAX_TOKENS
) -> str:
    """The reference text, cached; the lock keeps concurrent test threads to one generate."""
    with _REF_LOCK:
        return _reference(str(model_dir), images, text, max_tokens)


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()
