"""Loading `image_url`s into RGB PIL images.

Invariants:
- Every failure is an `EPDError` 400 naming the content part (`messages[i].content[j]`);
  nothing a client sends can produce a 500.
- Sources: base64 `data:` URLs, http(s) (overall deadline, byte cap enforced while
  streaming, optional domain allow-list checked on every redirect hop), and local files
  only under `allowed_local_media_path` (symlinks and `..` resolved before the check).
- The pixel count is checked from the header before any pixel is decoded, so a small file
  claiming a huge size is refused cheaply. Only PNG, JPEG, WEBP and GIF (first frame).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import httpx
from PIL import Image

from epd.errors import EPDError, invalid_request

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # JPEG includes MPO (camera JPEGs)
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaConfig:
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None  # exact host names; None: any
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    limit_images_per_request: int = 8

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None and not os.path.isdir(
            self.allowed_local_media_path
        ):
            raise ValueError(
                f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory"
            )
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower() for d in self.allowed_media_domains)
            if not all(domains) or any("/" in d for d in domains):
                raise ValueError("allowed_media_domains must be bare host names")
            object.__setattr__(self, "allowed_media_domains", domains)
        if not self.fetch_timeout_s > 0:
            raise ValueError("fetch_timeout_s must be > 0")
        if self.max_image_bytes <= 0 or self.max_image_pixels <= 0:
            raise ValueError("max_image_bytes and max_image_pixels must be > 0")
        if self.limit_images_per_request < 0:
            raise ValueError("limit_images_per_request must be >= 0")


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # where the image came from, e.g. "messages[0].content[1]"


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _image_refs(content: Any, prefix: str) -> list[ImageRef]:
    refs: list[ImageRef] = []
    if not isinstance(content, list):
        return refs
    for j, part in enumerate(content):
        if _get(part, "type") != "image_url":
            continue
        param = f"{prefix}content[{j}]"
        image_url = _get(part, "image_url")
        url = image_url if isinstance(image_url, str) else _get(image_url, "url")
        if not isinstance(url, str) or not url:
            raise invalid_request("image_url.url must be a non-empty string", param)
        refs.append(ImageRef(url=url, param=param))
    return refs


def _check_limit(refs: list[ImageRef], limit: int | None, param: str) -> list[ImageRef]:
    if limit is not None and len(refs) > limit:
        raise invalid_request(
            f"at most {limit} images per request are allowed, got {len(refs)}", param
        )
    return refs


def collect_image_parts(messages: Iterable[Any], *, limit: int | None = None) -> list[ImageRef]:
    """Image parts of chat messages (pydantic `Message`s or plain dicts), in order."""
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        refs.extend(_image_refs(_get(message, "content"), f"messages[{i}]."))
    return _check_limit(refs, limit, "messages")


def collect_content_image_parts(content: Any, *, limit: int | None = None) -> list[ImageRef]:
    """Image parts of one content list (the encoder's `/v1/encode` body)."""
    return _check_limit(_image_refs(content, ""), limit, "content")


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


# ------------------------------------------------------------------------------ sources


def _read_data_url(ref: ImageRef, config: MediaConfig) -> bytes:
    header, sep, payload = ref.url[len("data:") :].partition(",")
    params = header.split(";")
    if not sep or "base64" not in (p.strip().lower() for p in params[1:]):
        raise invalid_request(
            "only base64 data URLs (data:image/...;base64,...) are supported", ref.param
        )
    if params[0] and not params[0].lower().startswith("image/"):
        raise invalid_request(f"data URL media type must be image/*, got {params[0]!r}", ref.param)
    payload = "".join(payload.split())
    if len(payload) * 3 // 4 > config.max_image_bytes:
        raise _too_many_bytes(ref, config)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_request("the data URL is not valid base64", ref.param) from None


def _read_local(ref: ImageRef, config: MediaConfig) -> bytes:
    if config.allowed_local_media_path is None:
        raise invalid_request(
            f"image URL {_short(ref.url)!r} is not an http(s) or data URL, and local files are "
            "disabled (start the server with --allowed-local-media-path DIR to allow them)",
            ref.param,
        )
    path = ref.url
    if path.startswith("file:"):
        parts = urlsplit(path)
        if parts.netloc not in ("", "localhost"):
            raise invalid_request("file URLs must not name a remote host", ref.param)
        path = unquote(parts.path)
    root = os.path.realpath(config.allowed_local_media_path)
    target = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, target]) != root:
        raise invalid_request("the image file is outside --allowed-local-media-path", ref.param)
    if not os.path.isfile(target):
        raise invalid_request(f"image file {_short(path)!r} does not exist", ref.param)
    with open(target, "rb") as f:
        data = f.read(config.max_image_bytes + 1)
    if len(data) > config.max_image_bytes:
        raise _too_many_bytes(ref, config)
    return data


def _too_many_bytes(ref: ImageRef, config: MediaConfig) -> EPDError:
    return invalid_request(f"the image is larger than {config.max_image_bytes} bytes", ref.param)


def _check_domain(url: str, ref: ImageRef, config: MediaConfig) -> None:
    host = (urlsplit(url).hostname or "").lower()
    if not host:
        raise invalid_request(f"image URL {_short(url)!r} has no host", ref.param)
    if config.allowed_media_domains is not None and host not in config.allowed_media_domains:
        raise invalid_request(
            f"image domain {host!r} is not in the allowed media domains", ref.param
        )


def _check_response(resp: httpx.Response, ref: ImageRef, config: MediaConfig) -> None:
    if not resp.is_success:
        raise invalid_request(f"fetching the image failed with HTTP {resp.status_code}", ref.param)
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > config.max_image_bytes:
        raise _too_many_bytes(ref, config)


def _next_hop(resp: httpx.Response, url: str, ref: ImageRef, hops: int) -> str:
    if hops >= MAX_REDIRECTS:
        raise invalid_request("too many redirects fetching the image", ref.param)
    return urljoin(url, resp.headers.get("location", ""))


async def _fetch(ref: ImageRef, config: MediaConfig, client: httpx.AsyncClient) -> bytes:
    url = ref.url
    for hops in range(MAX_REDIRECTS + 1):
        _check_domain(url, ref, config)
        async with client.stream("GET", url, follow_redirects=False) as resp:
            if resp.is_redirect:
                url = _next_hop(resp, url, ref, hops)
                continue
            _check_response(resp, ref, config)
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > config.max_image_bytes:
                    raise _too_many_bytes(ref, config)
            return bytes(buf)
    raise invalid_request("too many redirects fetching the image", ref.param)


def _fetch_sync(ref: ImageRef, config: MediaConfig, client: httpx.Client) -> bytes:
    deadline = time.monotonic() + config.fetch_timeout_s
    url = ref.url
    for hops in range(MAX_REDIRECTS + 1):
        _check_domain(url, ref, config)
        with client.stream("GET", url, follow_redirects=False) as resp:
            if resp.is_redirect:
                url = _next_hop(resp, url, ref, hops)
                continue
            _check_response(resp, ref, config)
            buf = bytearray()
            for chunk in resp.iter_bytes():
                buf += chunk
                if len(buf) > config.max_image_bytes:
                    raise _too_many_bytes(ref, config)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("deadline exceeded")
            return bytes(buf)
    raise invalid_request("too many redirects fetching the image", ref.param)


def _fetch_failed(ref: ImageRef, config: MediaConfig, exc: Exception) -> EPDError:
    if isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError):
        return invalid_request(
            f"timed out after {config.fetch_timeout_s:g}s fetching the image", ref.param
        )
    return invalid_request(f"could not fetch the image: {type(exc).__name__}", ref.param)


def _scheme(url: str) -> str:
    head, sep, _ = url.partition(":")
    return head.lower() if sep and head.isalpha() and len(head) > 1 else ""


# ----------------------------------------------------------------------------- decoding


def decode_image(data: bytes, param: str, config: MediaConfig) -> Image.Image:
    """Bytes -> RGB image; the pixel count is checked before decoding."""
    Image.init()  # with an explicit `formats`, Image.open never loads the WEBP plugin itself
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise invalid_request(
            f"image too large: more than {config.max_image_pixels} pixels", param
        ) from None
    except Exception:
        raise invalid_request(
            "the data is not a supported image (PNG, JPEG, WEBP or GIF)", param
        ) from None
    width, height = img.size
    if width <= 0 or height <= 0:
        raise invalid_request(f"image has an invalid size {width}x{height}", param)
    if width * height > config.max_image_pixels:
        raise invalid_request(
            f"image too large: {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{config.max_image_pixels}",
            param,
        )
    try:
        img.load()  # the first frame only, for GIF / animated WEBP
        return img.convert("RGB")
    except Exception as exc:
        raise invalid_request(
            f"the image could not be decoded (truncated or corrupt): {exc}", param
        ) from None


# --------------------------------------------------------------------------------- entry


async def load_image(
    ref: ImageRef, config: MediaConfig, client: httpx.AsyncClient | None = None
) -> Image.Image:
    scheme = _scheme(ref.url)
    try:
        if scheme == "data":
            data = await asyncio.to_thread(_read_data_url, ref, config)
        elif scheme in ("http", "https"):
            if client is None:
                async with httpx.AsyncClient(timeout=config.fetch_timeout_s) as own:
                    return await load_image(ref, config, own)
            data = await asyncio.wait_for(_fetch(ref, config, client), config.fetch_timeout_s)
        elif scheme in ("", "file"):
            data = await asyncio.to_thread(_read_local, ref, config)
        else:
            raise invalid_request(
                f"unsupported image URL scheme {scheme!r}; use http(s), data or file", ref.param
            )
        return await asyncio.to_thread(decode_image, data, ref.param, config)
    except EPDError:
        raise
    except Exception as exc:
        raise _fetch_failed(ref, config, exc) from None


def load_image_sync(
    ref: ImageRef, config: MediaConfig, client: httpx.Client | None = None
) -> Image.Image:
    scheme = _scheme(ref.url)
    try:
        if scheme == "data":
            data = _read_data_url(ref, config)
        elif scheme in ("http", "https"):
            if client is None:
                with httpx.Client(timeout=config.fetch_timeout_s) as own:
                    return load_image_sync(ref, config, own)
            data = _fetch_sync(ref, config, client)
        elif scheme in ("", "file"):
            data = _read_local(ref, config)
        else:
            raise invalid_request(
                f"unsupported image URL scheme {scheme!r}; use http(s), data or file", ref.param
            )
        return decode_image(data, ref.param, config)
    except EPDError:
        raise
    except Exception as exc:
        raise _fetch_failed(ref, config, exc) from None


async def load_images(
    refs: Sequence[ImageRef], config: MediaConfig, client: httpx.AsyncClient | None = None
) -> list[Image.Image]:
    """Load concurrently, in order; the first failure cancels the rest and is raised."""
    if not refs:
        return []
    if client is None:
        async with httpx.AsyncClient(timeout=config.fetch_timeout_s) as own:
            return await load_images(refs, config, own)
    tasks = [asyncio.ensure_future(load_image(ref, config, client)) for ref in refs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
