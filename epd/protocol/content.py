"""OpenAI chat content: text and image_url parts, and messages.

Union branches are tagged in CamelCase so those tags never show up in an error's `param`
(`epd.errors` drops them from the location).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from epd.protocol._base import _Wire


class TextPart(_Wire):
    type: Literal["text"] = "text"
    text: str


class ImageURL(_Wire):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Wire):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL


def _part_tag(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return {"text": "TextPart", "image_url": "ImagePart"}.get(t) if isinstance(t, str) else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_content_part",
        custom_error_message="unsupported content part type; supported types are 'text' and 'image_url'",
    ),
]
Content = Annotated[
    Annotated[str, Tag("Text")] | Annotated[list[ContentPart], Tag("Parts")],
    Discriminator(
        lambda v: "Text" if isinstance(v, str) else "Parts" if isinstance(v, list) else None,
        custom_error_type="invalid_content",
        custom_error_message="content must be a string or a list of content parts",
    ),
]


class Message(_Wire):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Content | None = None
    name: str | None = None
