"""Images a request carries: taken from its body, bounded before any work, decoded off the loop.

Every API names an image its own way (OpenAI's ``image_url`` part and Responses'
``input_image`` with a data URL, Anthropic's base64 ``image`` source, Ollama's
``images`` list of base64 strings); each becomes an ``ImagePart``: the encoded text
and where in the body it was. What the event loop does with a part costs the same
whatever its size: its length is checked against MAX_IMAGE_BYTES and a data URL's
header (bounded) is read. Decoding (base64, then the picture) runs on a small pool
of threads of its own, never on the loop, and is bounded before it allocates: the
file's format among FORMATS (Pillow's other decoders are attack surface nobody
sends a model), its size from the header against MAX_IMAGE_PIXELS and
MAX_IMAGE_SIDE, before a pixel is decoded. So a decompression bomb, a 50,000 x
50,000 PNG, corrupt bytes or a data URL of something else is an ``ImageError`` in
milliseconds, naming the part; the answer is a 400.

An image comes out as mlx-vlm's processors take it: RGB, turned upright as its
EXIF orientation says (as mlx-vlm's own ``load_image`` does). Pillow is the
``vision`` extra: imported when the first image is decoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

# Images in one request: each is hundreds to thousands of a model's positions, and a
# request's images are decoded before its first token.
MAX_IMAGES = 16
# One image's file, decoded from base64: a phone's photo is 2-6 MB; the body's own bound
# (bodies.MAX_BODY_BYTES, 16 MiB of base64) allows about 12.
MAX_IMAGE_BYTES = 12 * 1024 * 1024
# Pixels of one image, read from its header before any is decoded: 8K (7680 x 4320) and a
# little; the models' processors scale far below it. As RGB this is at most ~100 MB.
MAX_IMAGE_PIXELS = 34_000_000
# Either side, in pixels: a 1 x 30,000,000 strip is within the count and no picture.
MAX_IMAGE_SIDE = 16_384
# What a request may send: what browsers and phones write, and what the models' own
# processors are tested on.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# A data URL's header ("data:image/png;base64,") is read up to this many characters.
MAX_DATA_URL_HEADER_CHARS = 100
# Threads decoding images at once: decoding is CPU work beside the stages' compute; more
# requests' images wait their turn (each a few milliseconds to a few hundred).
DECODE_THREADS = 2

_BASE64_PER_BYTE = 4 / 3


class ImageError(ValueError):
    """An image the request carries cannot be used: the message names the part and why (a 400)."""


@dataclass(frozen=True)
class ImagePart:
    """One image of a request: its base64 text (not decoded yet) and where in the body it is."""

    where: str  # e.g. "messages[0].content[1].image_url"
    data: str  # base64 from ``start`` on (a data URL's header before it), as the body carried it
    start: int = 0

    def __post_init__(self):
        # Checked on the loop, where it costs the same whatever the size (the base64 is not even
        # cut out of a data URL here: that is a copy of what the client sent).
        size = len(self.data) - self.start
        if size > MAX_IMAGE_BYTES * _BASE64_PER_BYTE + 4:
            raise ImageError(f"{self.where}: the image is over {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
        if size <= 0:
            raise ImageError(f"{self.where}: the image is empty")


def from_data_url(url: str, where: str) -> ImagePart:
    """An image from a ``data:image/...;base64,...`` URL (OpenAI's ``image_url``, Responses'
    ``input_image``); anything else is an ImageError that says what it is."""
    head, comma, data = url[: MAX_DATA_URL_HEADER_CHARS + 1].partition(",")
    if not url.startswith("data:"):
        raise ImageError(f"{where}: takes a data URL of an image (data:image/png;base64,...), got {url[:40]!r}")
    if not comma:
        raise ImageError(f"{where}: a data URL needs a ',' before its data, within its first {MAX_DATA_URL_HEADER_CHARS} characters (data:image/png;base64,...)")
    kind, *params = head[len("data:") :].split(";")
    if not kind.lower().startswith("image/"):
        raise ImageError(f"{where}: a data URL of {kind or 'text/plain'!r}, not an image (data:image/png;base64,...)")
    if "base64" not in (p.lower() for p in params):
        raise ImageError(f"{where}: an image's data URL must be base64 (data:{kind};base64,...)")
    return ImagePart(where, url, len(head) + 1)


def from_base64(data: object, where: str) -> ImagePart:
    """An image given as base64 text (Anthropic's ``source.data``, Ollama's ``images``)."""
    if not isinstance(data, str):
        raise ImageError(f"{where}: an image is base64 text, got {type(data).__name__}")
    return ImagePart(where, data)


def check_count(parts: Sequence[ImagePart]) -> None:
    if len(parts) > MAX_IMAGES:
        raise ImageError(f"{len(parts)} images in one request; at most {MAX_IMAGES} (MAX_IMAGES)")


@functools.cache
def _pillow():
    """Pillow, imported once: its warning for an image over 89 million pixels is ours to refuse
    (MAX_IMAGE_PIXELS, lower), not a line in the log for every client that sends one."""
    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    return Image


def decode(part: ImagePart):
    """The picture of ``part``: a Pillow RGB image, upright. Off the event loop (it costs what the
    client sent); an ImageError for anything that is not an image within the bounds."""
    Image = _pillow()
    from PIL import ImageOps, UnidentifiedImageError

    try:
        raw = base64.b64decode(part.data[part.start :], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{part.where}: the image is not valid base64") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise ImageError(f"{part.where}: the image is over {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise ImageError(f"{part.where}: not an image in a format ringd reads ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as e:  # Pillow's own bound, far above ours (its message has the size)
        raise ImageError(f"{part.where}: far over {MAX_IMAGE_PIXELS:,} pixels: {e}") from None
    except Exception as e:  # a header Pillow cannot make sense of
        raise ImageError(f"{part.where}: not a readable image ({type(e).__name__}: {e})") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1 or max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
            raise ImageError(
                f"{part.where}: {width} x {height} pixels; at most {MAX_IMAGE_PIXELS:,} pixels and {MAX_IMAGE_SIDE:,} a side"
            )  # fmt: skip
        try:
            upright = ImageOps.exif_transpose(image)  # decodes: a damaged body fails here
            return upright.convert("RGB")
        except Exception as e:  # OSError for a body cut short; whatever else a damaged file makes Pillow raise
            raise ImageError(f"{part.where}: the image is damaged or cut short ({type(e).__name__}: {e})") from None


_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="ringd-images")
    return _pool


async def decode_all(parts: Sequence[ImagePart]) -> list:
    """Every image of a request, decoded off the event loop, in order; the first ImageError (of the
    first bad part) if any is bad. Refused before any work past MAX_IMAGES."""
    check_count(parts)
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(_executor(), decode, part) for part in parts)))
