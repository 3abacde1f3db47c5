"""Pictures for the tests of models that see: generated, so a test needs no image files."""

from __future__ import annotations

import base64
import io

import numpy as np


def gradient(width: int = 64, height: int = 64, turn: int = 0):
    """A picture whose every pixel differs from its neighbours (red across, green down, blue
    against red), turned ``turn`` quarter turns: four pictures a model tells apart."""
    from PIL import Image

    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    image = Image.fromarray(np.stack([x, y, 255 - x], -1).astype(np.uint8), "RGB")
    return image.rotate(90 * turn, expand=True) if turn else image


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def base64_png(image) -> str:
    return base64.b64encode(png(image)).decode()


def data_url(image) -> str:
    return "data:image/png;base64," + base64_png(image)
