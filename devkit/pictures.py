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


def bomb(width: int, height: int, whole: bool = True) -> bytes:
    """A PNG of ``width`` x ``height`` black pixels: ``whole``, every row compressed (a real
    decompression bomb: a few hundred KB that inflate to width x height x 3 bytes); else its
    header and a few bytes of data (what a bomb looks like before it is inflated)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    if whole:
        packer, row = zlib.compressobj(9), b"\0" * (1 + 3 * width)
        data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    else:
        data = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
