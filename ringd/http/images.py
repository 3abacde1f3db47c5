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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from ringd.ring.media import MAX_IMAGE_BYTES, MAX_IMAGES, ImageError, Picture, picture

# An image's web URL, at most: what browsers take; the body's own bound is far above it.
MAX_URL_CHARS = 8192
# Fetching one image from the web (where fetch_image_urls allows it), connecting and reading it all.
FETCH_TIMEOUT_S = 20.0
# Redirects a fetch follows: a CDN's one or two.
MAX_REDIRECTS = 3
# Bytes read at a time from a fetched image's body, each checked against MAX_IMAGE_BYTES.
FETCH_CHUNK_BYTES = 64 * 1024
# How to turn fetching on, in the refusal of a request that names a web URL.
FETCH_HINT = (
    "set fetch_image_urls: true in the leader's config to have ringd fetch it (a server that fetches what a client "
    "names is a door into the network it sits in: only where every client is trusted), or send the image itself "
    "as a data URL (data:image/png;base64,...)"
)
# A data URL's header ("data:image/png;base64,") is read up to this many characters.
MAX_DATA_URL_HEADER_CHARS = 100
# Threads decoding images at once: decoding is CPU work beside the stages' compute; more
# requests' images wait their turn (each a few milliseconds to a few hundred).
DECODE_THREADS = 2

_BASE64_PER_BYTE = 4 / 3


@dataclass(frozen=True)
class ImagePart:
    """One image of a request: its base64 text (not decoded yet) and where in the body it is."""

    where: str  # e.g. "messages[0].content[1].image_url"
    data: str  # base64 from ``start`` on (a data URL's header before it), as the body carried it
    start: int = 0
    url: str | None = None  # an image named by its http(s) URL instead (``data`` empty): fetched where allowed

    def __post_init__(self):
        if self.url is not None:
            if len(self.url) > MAX_URL_CHARS:
                raise ImageError(f"{self.where}: an image's URL of over {MAX_URL_CHARS} characters")
            return
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


def from_web(url: str, where: str) -> ImagePart:
    """An image named by its http(s) URL: fetched only where ``fetch_image_urls`` allows (``fetch``)."""
    return ImagePart(where, "", url=url)


def is_web_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def from_base64(data: object, where: str) -> ImagePart:
    """An image given as base64 text (Anthropic's ``source.data``, Ollama's ``images``)."""
    if not isinstance(data, str):
        raise ImageError(f"{where}: an image is base64 text, got {type(data).__name__}")
    return ImagePart(where, data)


def check_count(parts: Sequence[ImagePart]) -> None:
    if len(parts) > MAX_IMAGES:
        raise ImageError(f"{len(parts)} images in one request; at most {MAX_IMAGES} (MAX_IMAGES)")


def decode(part: ImagePart) -> Picture:
    """The picture of ``part``, and its file's bytes. Off the event loop (it costs what the client
    sent); an ImageError for anything that is not an image within the bounds."""
    try:
        raw = base64.b64decode(part.data[part.start :], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{part.where}: the image is not valid base64") from None
    return picture(raw, part.where)


_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="ringd-images")
    return _pool


async def decode_all(parts: Sequence[ImagePart], fetch_urls: bool = False) -> list[Picture]:
    """Every image of a request, decoded off the event loop, in order; the first ImageError (of the
    first bad part) if any is bad. Refused before any work past MAX_IMAGES, or where a part names
    a web URL and ``fetch_urls`` is off; with it on, such a part is fetched first (``fetch``)."""
    check_count(parts)
    for part in parts:
        if part.url is not None and not fetch_urls:
            raise ImageError(f"{part.where}: ringd does not fetch images from the web unless told to: {FETCH_HINT}")
    loop = asyncio.get_running_loop()

    async def one(part: ImagePart) -> Picture:
        if part.url is None:
            return await loop.run_in_executor(_executor(), decode, part)
        raw = await fetch(part)
        return await loop.run_in_executor(_executor(), picture, raw, part.where)

    return list(await asyncio.gather(*(one(part) for part in parts)))


async def fetch(part: ImagePart) -> bytes:
    """The file at a part's web URL: within FETCH_TIMEOUT_S, MAX_REDIRECTS and MAX_IMAGE_BYTES (read
    a chunk at a time, so a server that sends more is cut off, not held). An ImageError naming the
    part and the URL for anything else."""
    import aiohttp

    url = part.url
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as session:
            async with session.get(url, max_redirects=MAX_REDIRECTS, headers={"Accept": "image/*"}) as r:
                if r.status != 200:
                    raise ImageError(f"{part.where}: fetching {url[:200]} answered HTTP {r.status}")
                if (r.content_length or 0) > MAX_IMAGE_BYTES:
                    raise ImageError(f"{part.where}: {url[:200]} is over {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
                out = bytearray()
                async for chunk in r.content.iter_chunked(FETCH_CHUNK_BYTES):
                    out += chunk
                    if len(out) > MAX_IMAGE_BYTES:
                        raise ImageError(f"{part.where}: {url[:200]} is over {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
                return bytes(out)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"{part.where}: could not fetch {url[:200]}: {type(e).__name__}: {e}") from None
