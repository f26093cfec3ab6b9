"""epd.encoder.media: every accepted source/format and every rejection, as a 400 naming the part."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from epd.encoder.media import (
    ImageRef,
    MediaConfig,
    collect_content_image_parts,
    collect_image_parts,
    load_image,
    load_image_sync,
    load_images,
)
from epd.errors import EPDError
from epd.protocol import ChatCompletionRequest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "images"
PARAM = "messages[0].content[1]"


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def huge_png_header(width: int, height: int) -> bytes:
    """A valid PNG signature + IHDR claiming width x height, with a tiny IDAT: no pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def rejects(ref: ImageRef, config: MediaConfig, needle: str) -> EPDError:
    with pytest.raises(EPDError) as info:
        load_image_sync(ref, config)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == ref.param
    assert needle in err.message, err.message
    return err


def rejects_async(ref: ImageRef, config: MediaConfig, needle: str) -> EPDError:
    with pytest.raises(EPDError) as info:
        asyncio.run(load_image(ref, config))
    assert info.value.status == 400 and info.value.param == ref.param
    assert needle in info.value.message, info.value.message
    return info.value


CFG = MediaConfig()
RGB = Image.new("RGB", (12, 8), (200, 30, 60))


# --------------------------------------------------------------------------- collection


def test_collect_image_parts_from_pydantic_and_dicts():
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "http://a/x.png"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            ],
        },
    ]
    expected = [
        ImageRef("http://a/x.png", "messages[1].content[1]"),
        ImageRef("data:image/png;base64,AA==", "messages[1].content[2]"),
    ]
    assert collect_image_parts(messages) == expected
    req = ChatCompletionRequest(model="m", messages=messages)
    assert collect_image_parts(req.messages) == expected
    content = messages[1]["content"]
    assert [r.param for r in collect_content_image_parts(content)] == ["content[1]", "content[2]"]


def test_too_many_images_names_messages_and_limit():
    part = {"type": "image_url", "image_url": {"url": "http://a/x.png"}}
    messages = [{"role": "user", "content": [part, part, part]}]
    with pytest.raises(EPDError) as info:
        collect_image_parts(messages, limit=2)
    assert info.value.param == "messages" and "at most 2 images" in info.value.message
    with pytest.raises(EPDError) as info:
        collect_content_image_parts([part] * 3, limit=2)
    assert info.value.param == "content" and info.value.status == 400


def test_media_config_validation(tmp_path):
    with pytest.raises(ValueError):
        MediaConfig(allowed_local_media_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError):
        MediaConfig(fetch_timeout_s=0)
    with pytest.raises(ValueError):
        MediaConfig(allowed_media_domains=("http://x.com/",))
    cfg = MediaConfig(allowed_media_domains=("Example.COM ",))
    assert cfg.allowed_media_domains == ("example.com",)


# ---------------------------------------------------------------------- formats (data:)


@pytest.mark.parametrize(
    "fmt,mime,img",
    [
        ("PNG", "image/png", RGB.convert("RGBA")),
        ("JPEG", "image/jpeg", RGB),
        ("WEBP", "image/webp", RGB),
        ("GIF", "image/gif", RGB.convert("P", palette=Image.Palette.ADAPTIVE)),
    ],
)
def test_accepted_formats_decode_to_rgb(fmt, mime, img):
    out = load_image_sync(ImageRef(data_url(encode(img, fmt), mime), PARAM), CFG)
    assert out.mode == "RGB" and out.size == (12, 8)
    r, g, b = out.getpixel((5, 4))
    assert abs(r - 200) < 12 and abs(g - 30) < 12 and abs(b - 60) < 12


def test_gif_first_frame():
    frames = [Image.new("P", (4, 4), 1), Image.new("P", (4, 4), 2)]
    palette = [0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * (256 * 3 - 9)
    for f in frames:
        f.putpalette(palette)
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    out = load_image_sync(ImageRef(data_url(buf.getvalue(), "image/gif"), PARAM), CFG)
    assert out.getpixel((0, 0)) == (255, 0, 0)


def test_data_url_rejections():
    png = encode(RGB, "PNG")
    rejects(ImageRef("data:image/png;base64,@@not-base64@@", PARAM), CFG, "not valid base64")
    rejects(ImageRef("data:image/png," + png.hex(), PARAM), CFG, "base64")
    rejects(ImageRef(data_url(png, "text/plain"), PARAM), CFG, "image/*")
    rejects(ImageRef(data_url(b"hello, not an image"), PARAM), CFG, "not a supported image")
    rejects(ImageRef(data_url(encode(RGB, "BMP")), PARAM), CFG, "not a supported image")
    small = MediaConfig(max_image_bytes=len(png) // 2)
    rejects(ImageRef(data_url(png), PARAM), small, "larger than")


def test_truncated_png():
    noisy = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    png = encode(noisy, "PNG")
    rejects(ImageRef(data_url(png[: len(png) // 2]), PARAM), CFG, "could not be decoded")


def test_huge_header_rejected_before_decoding():
    bomb = huge_png_header(30000, 30000)
    assert len(bomb) < 200
    err = rejects(ImageRef(data_url(bomb), PARAM), CFG, "image too large")
    assert str(CFG.max_image_pixels) in err.message
    # Below Pillow's own bomb threshold, our limit applies with the real size.
    tight = MediaConfig(max_image_pixels=1000)
    err = rejects(ImageRef(data_url(huge_png_header(100, 100)), PARAM), tight, "100x100")


def test_unknown_scheme():
    rejects(ImageRef("ftp://example.com/a.png", PARAM), CFG, "unsupported image URL scheme")


# ------------------------------------------------------------------------- local files


@pytest.fixture()
def media_dir(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "sub").mkdir()
    Image.new("RGB", (6, 5), (1, 2, 3)).save(root / "sub" / "ok.png")
    secret = tmp_path / "secret.png"
    Image.new("RGB", (6, 5)).save(secret)
    os.symlink(secret, root / "escape.png")
    os.symlink(root / "sub" / "ok.png", root / "inside.png")
    return root


def test_local_files_under_allowed_dir(media_dir):
    cfg = MediaConfig(allowed_local_media_path=str(media_dir))
    for url in (
        str(media_dir / "sub" / "ok.png"),
        f"file://{media_dir / 'sub' / 'ok.png'}",
        "sub/ok.png",
        str(media_dir / "inside.png"),
    ):
        assert load_image_sync(ImageRef(url, PARAM), cfg).getpixel((0, 0)) == (1, 2, 3)
    example = MediaConfig(allowed_local_media_path=str(EXAMPLES))
    assert asyncio.run(load_image(ImageRef("cat.png", PARAM), example)).size == (180, 180)


def test_local_file_rejections(media_dir):
    cfg = MediaConfig(allowed_local_media_path=str(media_dir))
    outside = "outside --allowed-local-media-path"
    rejects(ImageRef("../secret.png", PARAM), cfg, outside)
    rejects(ImageRef(f"{media_dir}/sub/../../secret.png", PARAM), cfg, outside)
    rejects(ImageRef(str(media_dir.parent / "secret.png"), PARAM), cfg, outside)
    rejects(ImageRef(str(media_dir / "escape.png"), PARAM), cfg, outside)
    rejects(ImageRef("file://otherhost/etc/passwd", PARAM), cfg, "remote host")
    rejects(ImageRef("sub/missing.png", PARAM), cfg, "does not exist")
    rejects(ImageRef("sub", PARAM), cfg, "does not exist")
    err = rejects(ImageRef(str(media_dir / "sub" / "ok.png"), PARAM), CFG, "local files")
    assert "--allowed-local-media-path" in err.message


# ------------------------------------------------------------------------------- http

PNG_BYTES = encode(Image.new("RGB", (7, 3), (9, 8, 7)), "PNG")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None):
        self.send_response(status)
        for k, v in (headers or {"Content-Length": str(len(body))}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        if self.path == "/img.png":
            self._send(200, PNG_BYTES)
        elif self.path == "/missing.png":
            self._send(404, b"nope")
        elif self.path == "/redirect":
            self._send(302, headers={"Location": "/img.png", "Content-Length": "0"})
        elif self.path == "/redirect-away":
            loc = f"http://localhost:{port}/img.png"
            self._send(302, headers={"Location": loc, "Content-Length": "0"})
        elif self.path == "/declared-huge":
            self._send(200, b"x" * 10, {"Content-Length": str(10**9)})
        elif self.path == "/undeclared-big":
            self._send(200, os.urandom(5000), {"Content-Type": "image/png"})
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(30):  # trickle: every read succeeds, the total takes 3 s
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass
        else:
            self._send(500, b"?")


@pytest.fixture(scope="module")
def http_base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.block_on_close = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_fetch_sync_async_and_redirect(http_base):
    for path in ("/img.png", "/redirect", "/redirect-away"):
        ref = ImageRef(http_base + path, PARAM)
        assert load_image_sync(ref, CFG).getpixel((0, 0)) == (9, 8, 7)
        assert asyncio.run(load_image(ref, CFG)).size == (7, 3)


def test_http_rejections(http_base):
    cfg = MediaConfig(fetch_timeout_s=0.4, max_image_bytes=1000)
    for check in (rejects, rejects_async):
        check(ImageRef(http_base + "/missing.png", PARAM), cfg, "HTTP 404")
        check(ImageRef(http_base + "/slow", PARAM), cfg, "timed out after 0.4s")
        check(ImageRef(http_base + "/declared-huge", PARAM), cfg, "larger than 1000 bytes")
        check(ImageRef(http_base + "/undeclared-big", PARAM), cfg, "larger than 1000 bytes")
        check(ImageRef("http://127.0.0.1:9/img.png", PARAM), cfg, "could not fetch")


def test_domain_allow_list(http_base):
    allowed = MediaConfig(allowed_media_domains=("127.0.0.1",))
    assert load_image_sync(ImageRef(http_base + "/img.png", PARAM), allowed).size == (7, 3)
    other = MediaConfig(allowed_media_domains=("example.com",))
    rejects(ImageRef(http_base + "/img.png", PARAM), other, "'127.0.0.1' is not in the allowed")
    # Every redirect hop is checked: 127.0.0.1 -> localhost is refused.
    rejects_async(ImageRef(http_base + "/redirect-away", PARAM), allowed, "'localhost'")


def test_load_images_concurrent_in_order_and_first_error(http_base):
    refs = [
        ImageRef(http_base + "/img.png", "content[0]"),
        ImageRef(data_url(encode(RGB, "PNG")), "content[1]"),
        ImageRef(http_base + "/redirect", "content[2]"),
    ]
    images = asyncio.run(load_images(refs, CFG))
    assert [im.size for im in images] == [(7, 3), (12, 8), (7, 3)]
    bad = [*refs[:2], ImageRef(http_base + "/missing.png", "content[2]")]
    with pytest.raises(EPDError) as info:
        asyncio.run(load_images(bad, CFG))
    assert info.value.param == "content[2]" and "404" in info.value.message
    assert asyncio.run(load_images([], CFG)) == []


def test_example_images_load():
    cfg = MediaConfig(allowed_local_media_path=str(EXAMPLES))
    names = sorted(p.name for p in EXAMPLES.iterdir())
    refs = [ImageRef(name, f"content[{i}]") for i, name in enumerate(names)]
    images = asyncio.run(load_images(refs, cfg))
    assert all(im.mode == "RGB" for im in images)
    assert dict(zip(names, (im.size for im in images), strict=True))["sunset.png"] == (320, 240)
