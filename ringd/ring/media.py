"""A prompt's images as they travel from the leader to the ring's first stage (MEDIA).

The leader renders a request with images into its prompt's text (one marker per image,
as the model's chat template writes it) and its ids (each marker expanded to the tokens
the image takes, by the model's processor). The first stage runs the vision tower, so it
needs the images; it runs the same processor over the same text and images to get the
pixels the tower reads, and checks that it makes the ids the leader sent (the two agree
or the request fails, never a wrong answer). So a MEDIA frame carries the text and the
images' encoded bytes (a photo's file is a few MB, its pixels as float32 for a model's
processor up to hundreds), and goes before the request's first FORWARD on each ring:
the link keeps their order, and a replay on the next ring sends it again.

The descriptor is JSON (``{"term", "text": bytes, "images": [bytes, ...]}``), the
payload the text's UTF-8 then each image's file; every length is checked against the
named limits below and against the payload before anything is kept.
"""

from __future__ import annotations

import functools
import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

from wire.frames import Frame, FrameError, MsgType

# Images in one request: each is hundreds to thousands of a model's positions, and a
# request's images are decoded before its first token.
MAX_IMAGES = 16
# One image's file: a phone's photo is 2-6 MB; a request body's own bound
# (http/bodies.MAX_BODY_BYTES, 16 MiB of base64) allows about 12.
MAX_IMAGE_BYTES = 12 * 1024 * 1024
# A prompt's text, in UTF-8 bytes: past any context a model has (a million tokens of a
# few bytes each), so it bounds what a peer's frame makes the first stage tokenize.
MAX_TEXT_BYTES = 8 * 1024 * 1024
# Pixels of one image, read from its header before any is decoded: 8K (7680 x 4320) and a
# little; the models' processors scale far below it. As RGB this is at most ~100 MB.
MAX_IMAGE_PIXELS = 34_000_000
# Either side, in pixels: a 1 x 30,000,000 strip is within the count and no picture.
MAX_IMAGE_SIDE = 16_384
# What a request may send: what browsers and phones write, and what the models' own
# processors are tested on.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """An image that cannot be used: the message names which and why (a client's: a 400)."""


@dataclass(frozen=True, eq=False)
class Picture:
    """An image as a model's processor takes it (``image``: Pillow, RGB, upright) and the bytes
    of its file (``raw``: what travels to the first stage and keys a cached prefix)."""

    raw: bytes
    image: Any


@functools.cache
def _pillow():
    """Pillow, imported once (the ``vision`` extra): its warning for an image over 89 million
    pixels is ours to refuse (MAX_IMAGE_PIXELS, lower), not a line in the log for every one."""
    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    return Image


def picture(raw: bytes, where: str) -> Picture:
    """The picture in an image file's bytes: bounded before a pixel is decoded (its format among
    FORMATS, Pillow's other decoders being attack surface nobody sends a model; its size from
    the header), turned upright as its EXIF orientation says and to RGB (as mlx-vlm's own
    ``load_image``). Costs what the file holds: off the event loop. An ImageError, naming
    ``where``, for anything that is not such an image."""
    Image = _pillow()
    from PIL import ImageOps, UnidentifiedImageError

    if len(raw) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: the image is over {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not an image in a format ringd reads ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as e:  # Pillow's own bound, far above ours (its message has the size)
        raise ImageError(f"{where}: far over {MAX_IMAGE_PIXELS:,} pixels: {e}") from None
    except Exception as e:  # a header Pillow cannot make sense of
        raise ImageError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1 or max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
            raise ImageError(
                f"{where}: {width} x {height} pixels; at most {MAX_IMAGE_PIXELS:,} pixels and {MAX_IMAGE_SIDE:,} a side"
            )  # fmt: skip
        try:
            upright = ImageOps.exif_transpose(image)  # decodes: a damaged body fails here
            return Picture(raw, upright.convert("RGB"))
        except Exception as e:  # OSError for a body cut short; whatever else a damaged file makes Pillow raise
            raise ImageError(f"{where}: the image is damaged or cut short ({type(e).__name__}: {e})") from None


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A request's images as its leader keeps them: the prompt's ``text`` that the first stage's
    processor reads with them, their ``files``, ``key``: the prompt's ids as the prefix cache
    keys them (``prefix_key``), and ``payload``: their MEDIA frame's, joined once (``of``, off
    the event loop: it costs what the client sent), sent again on every ring as it is."""

    text: str
    files: tuple[bytes, ...]
    key: tuple[int, ...]
    payload: bytes
    text_bytes: int

    @classmethod
    def of(cls, text: str, files: tuple[bytes, ...], ids: list[int], image_token: int | None) -> "PromptImages":
        encoded = text.encode()
        return cls(text, files, prefix_key(ids, image_token, files), b"".join([encoded, *files]), len(encoded))

    def frame(self, rid: int, term: int) -> Frame:
        """Their MEDIA frame for request ``rid`` on ring ``term``."""
        return Frame(MsgType.MEDIA, rid, _descriptor(term, self.text_bytes, self.files), self.payload)


def _descriptor(term: int, text_bytes: int, files: tuple[bytes, ...]) -> dict:
    return {"term": term, "text": text_bytes, "images": [len(f) for f in files]}


def prefix_key(ids: list[int], image_token: int | None, files: tuple[bytes, ...]) -> tuple[int, ...]:
    """``ids`` as a cached prefix is found by: each image's positions (its run of the image token;
    they all hold the same id whatever the picture) stand for the image's bytes and their place in
    it, as negative numbers no token has. Two prompts share a prefix through an image only if it is
    the same file. Where the runs are not one an image (a template that writes two images' tokens
    side by side), every image position stands for all the files at once."""
    digests = [hashlib.blake2b(f, digest_size=8).digest() for f in files]
    runs: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == image_token:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    if len(runs) != len(digests):
        runs = [[i for run in runs for i in run]]
        digests = [b"".join(digests)]
    out = list(ids)
    for run, digest in zip(runs, digests):
        for k, i in enumerate(run):
            h = hashlib.blake2b(digest + k.to_bytes(4, "little"), digest_size=8).digest()
            out[i] = -1 - (int.from_bytes(h, "little") >> 2)
    return tuple(out)


@dataclass(frozen=True)
class Media:
    """Request ``rid``'s prompt text and images (their files' bytes), for ring ``term``."""

    rid: int
    term: int
    text: str
    images: tuple[bytes, ...]

    def frame(self) -> Frame:
        text = self.text.encode()
        return Frame(MsgType.MEDIA, self.rid, _descriptor(self.term, len(text), self.images), b"".join([text, *self.images]))

    @classmethod
    def parse(cls, frame: Frame) -> "Media":
        d = frame.descriptor
        if not isinstance(d, dict) or set(d) != {"term", "text", "images"}:
            raise FrameError(f"MEDIA descriptor must be {{term, text, images}}, got {d!r:.200}")
        term, text, images = d["term"], d["text"], d["images"]
        if type(term) is not int or term < 0:
            raise FrameError(f"MEDIA 'term' must be a non-negative integer, got {term!r:.40}")
        if type(text) is not int or not 0 <= text <= MAX_TEXT_BYTES:
            raise FrameError(f"MEDIA 'text' must be its length in bytes, at most {MAX_TEXT_BYTES}, got {text!r:.40}")
        if not isinstance(images, list) or not 1 <= len(images) <= MAX_IMAGES:
            raise FrameError(f"MEDIA 'images' must list 1 to {MAX_IMAGES} lengths, got {images!r:.200}")
        if not all(type(n) is int and 0 < n <= MAX_IMAGE_BYTES for n in images):
            raise FrameError(f"MEDIA image lengths must be integers in [1, {MAX_IMAGE_BYTES}], got {images!r:.200}")
        payload = memoryview(frame.payload)
        if len(payload) != text + sum(images):
            raise FrameError(f"MEDIA payload is {len(payload)} bytes; its descriptor declares {text + sum(images)}")
        try:
            prompt = bytes(payload[:text]).decode()
        except UnicodeDecodeError as e:
            raise FrameError(f"MEDIA text is not UTF-8: {e}") from None
        out, at = [], text
        for n in images:
            out.append(bytes(payload[at : at + n]))
            at += n
        return cls(frame.request_id, term, prompt, tuple(out))

    @property
    def nbytes(self) -> int:
        """What it holds, about (its text counted in characters)."""
        return len(self.text) + sum(len(i) for i in self.images)
