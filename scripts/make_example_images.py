"""Draw the example images in examples/images/ with Pillow (deterministic)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "examples" / "images"


def sunset(w: int = 320, h: int = 240) -> Image.Image:
    img = Image.new("RGB", (w, h))
    d = ImageDraw.Draw(img)
    for y in range(h):
        t = y / h
        d.line([(0, y), (w, y)], fill=(int(250 - 90 * t), int(140 - 100 * t), int(60 + 90 * t)))
    d.ellipse([w * 0.55, h * 0.35, w * 0.75, h * 0.35 + w * 0.2], fill=(255, 210, 80))
    d.polygon([(0, h), (w * 0.3, h * 0.45), (w * 0.6, h), ], fill=(60, 40, 70))
    d.polygon([(w * 0.35, h), (w * 0.7, h * 0.55), (w, h * 0.8), (w, h)], fill=(40, 30, 55))
    return img


def bar_chart(w: int = 256, h: int = 384) -> Image.Image:
    img = Image.new("RGB", (w, h), (248, 248, 242))
    d = ImageDraw.Draw(img)
    d.line([(30, 20), (30, h - 30), (w - 10, h - 30)], fill=(20, 20, 20), width=3)
    colors = [(220, 60, 60), (60, 140, 220), (70, 180, 90), (240, 170, 40), (150, 80, 200)]
    for i, v in enumerate([0.8, 0.45, 0.95, 0.3, 0.6]):
        x0 = 40 + i * 42
        d.rectangle([x0, (h - 30) - v * (h - 70), x0 + 30, h - 31], fill=colors[i])
    for y in range(40, h - 30, 40):
        d.line([(26, y), (34, y)], fill=(20, 20, 20), width=2)
    return img


def city_street(w: int = 400, h: int = 200) -> Image.Image:
    rng = random.Random(7)
    img = Image.new("RGB", (w, h), (135, 190, 235))
    d = ImageDraw.Draw(img)
    x = 0
    while x < w:
        bw, bh = rng.randint(30, 70), rng.randint(60, 150)
        c = tuple(rng.randint(90, 200) for _ in range(3))
        d.rectangle([x, h - 40 - bh, x + bw, h - 40], fill=c)
        for wy in range(h - 40 - bh + 8, h - 50, 16):
            for wx in range(x + 6, x + bw - 8, 14):
                d.rectangle([wx, wy, wx + 7, wy + 9], fill=(255, 240, 150))
        x += bw + rng.randint(2, 10)
    d.rectangle([0, h - 40, w, h], fill=(70, 70, 75))
    for sx in range(10, w, 50):
        d.rectangle([sx, h - 22, sx + 25, h - 18], fill=(240, 240, 240))
    d.rectangle([150, h - 62, 230, h - 30], fill=(200, 30, 30))
    d.ellipse([160, h - 38, 178, h - 20], fill=(20, 20, 20))
    d.ellipse([205, h - 38, 223, h - 20], fill=(20, 20, 20))
    return img


def cat_face(w: int = 180, h: int = 180) -> Image.Image:
    img = Image.new("RGB", (w, h), (200, 230, 200))
    d = ImageDraw.Draw(img)
    d.polygon([(40, 70), (55, 15), (85, 55)], fill=(230, 140, 50))
    d.polygon([(140, 70), (125, 15), (95, 55)], fill=(230, 140, 50))
    d.ellipse([30, 40, 150, 160], fill=(240, 150, 60))
    d.ellipse([60, 80, 80, 100], fill=(30, 120, 40))
    d.ellipse([100, 80, 120, 100], fill=(30, 120, 40))
    d.polygon([(85, 112), (95, 112), (90, 120)], fill=(240, 100, 130))
    for dy in (-6, 0, 6):
        d.line([(50, 118 + dy), (80, 116)], fill=(60, 40, 20))
        d.line([(130, 118 + dy), (100, 116)], fill=(60, 40, 20))
    return img


def spiral(w: int = 96, h: int = 160) -> Image.Image:
    img = Image.new("RGB", (w, h), (15, 15, 40))
    d = ImageDraw.Draw(img)
    cx, cy = w / 2, h / 2
    pts = [(cx + 2.2 * t * math.cos(t), cy + 2.2 * t * math.sin(t)) for t in [i * 0.1 for i in range(200)]]
    d.line(pts, fill=(120, 220, 255), width=3)
    return img


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    sunset().save(OUT / "sunset.png")
    bar_chart().save(OUT / "bar_chart.jpg", quality=90)
    city_street().save(OUT / "city_street.jpg", quality=90)
    cat_face().save(OUT / "cat.png")
    spiral().save(OUT / "spiral.webp")


if __name__ == "__main__":
    main()
