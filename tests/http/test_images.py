"""ringd.http.images: an image a request carries, bounded before work and decoded off the loop.

Real files made by Pillow (PNG, JPEG with an EXIF orientation, an animated GIF), a PNG whose
header claims 50,000 x 50,000 pixels (written chunk by chunk, as a bomb is), a 10,000 x 10,000
PNG that compresses to a few kilobytes, corrupt and cut bytes, data URLs of other things, and
arbitrary text under Hypothesis: each is a picture or an ImageError naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from devkit.pictures import bomb

from ringd.http import images
from ringd.http.images import MAX_IMAGES, ImageError, ImagePart, decode, decode_all, from_base64, from_data_url


def encoded(image: Image.Image, fmt: str, **save) -> str:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return base64.b64encode(out.getvalue()).decode()


def gradient(width: int = 48, height: int = 32) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata([(x * 5 % 256, y * 7 % 256, (x + y) % 256) for y in range(height) for x in range(width)])
    return image


def png_claiming(width: int, height: int) -> bytes:
    return bomb(width, height, whole=False)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP"])
def test_a_data_url_of_each_format_decodes_to_rgb_of_its_size(fmt):
    decoded = decode(from_data_url(f"data:image/{fmt.lower()};base64,{encoded(gradient(), fmt)}", "messages[0].content[1].image_url"))
    assert decoded.raw == base64.b64decode(encoded(gradient(), fmt))  # the file, as it travels to the ring
    picture = decoded.image
    assert picture.mode == "RGB" and picture.size == (48, 32)
    if fmt in ("PNG", "BMP"):  # lossless: the very pixels
        assert picture.tobytes() == gradient().tobytes()


def test_an_exif_orientation_turns_the_picture_upright_and_a_gif_gives_its_first_frame():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the camera was held on its side
    upright = decode(from_base64(encoded(gradient(48, 32), "JPEG", exif=exif), "images[0]")).image
    assert upright.size == (32, 48)
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    first = decode(from_base64(base64.b64encode(out.getvalue()).decode(), "images[0]")).image
    assert first.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    "url, said",
    [
        ("https://example.com/cat.png", "takes a data URL"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain', not an image"),
        ("data:,hello", "not an image"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64" + "A" * 200, "needs a ','"),
        ("data:image/png;base64,%%%not-base64%%%", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a but not really").decode(), "not an image in a format"),
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(), "messages[2].content[0]"),
    ],
)
def test_what_is_not_an_image_is_refused_naming_the_part(url, said):
    with pytest.raises(ImageError, match="messages\\[2\\]\\.content\\[0\\]") as e:
        decode(from_data_url(url, "messages[2].content[0]"))
    assert said in str(e.value)


def test_a_bomb_is_refused_from_its_header_before_a_pixel_is_decoded():
    claims = base64.b64encode(png_claiming(50_000, 50_000)).decode()
    with pytest.raises(ImageError, match="far over 34,000,000 pixels: .*2500000000 pixels"):
        decode(from_base64(claims, "images[0]"))
    # A real one: 100 million black pixels compress to a few kilobytes.
    bomb = encoded(Image.new("L", (10_000, 10_000)), "PNG", optimize=True)
    assert len(bomb) < 200_000
    with pytest.raises(ImageError, match="10000 x 10000 pixels"):
        decode(from_base64(bomb, "images[1]"))
    with pytest.raises(ImageError, match="1 x 20000 pixels"):  # a strip within the count
        decode(from_base64(base64.b64encode(png_claiming(1, 20_000)).decode(), "images[2]"))


def test_a_picture_cut_short_or_damaged_is_refused():
    whole = base64.b64decode(encoded(gradient(), "PNG"))
    with pytest.raises(ImageError, match="damaged or cut short"):
        decode(from_base64(base64.b64encode(whole[: len(whole) // 2]).decode(), "images[0]"))


def test_size_and_count_are_refused_before_any_work():
    with pytest.raises(ImageError, match="over 12 MiB"):
        ImagePart("images[0]", "A" * (13 * 1024 * 1024 * 4 // 3))
    with pytest.raises(ImageError, match="empty"):
        from_base64("", "images[0]")
    with pytest.raises(ImageError, match="base64 text, got int"):
        from_base64(5, "images[0]")
    part = from_base64(encoded(gradient(4, 4), "PNG"), "images[0]")
    with pytest.raises(ImageError, match=f"{MAX_IMAGES + 84} images in one request"):
        asyncio.run(decode_all([part] * (MAX_IMAGES + 84)))


def test_a_request_s_images_decode_off_the_loop_in_order_and_the_first_bad_one_is_named():
    parts = [from_base64(encoded(gradient(8 + i, 8), "PNG"), f"images[{i}]") for i in range(5)]

    async def main():
        loop_thread = __import__("threading").get_ident()
        seen = []
        real = images.decode

        def spy(part):
            seen.append(__import__("threading").get_ident())
            return real(part)

        images.decode = spy
        try:
            pictures = await decode_all(parts)
        finally:
            images.decode = real
        assert loop_thread not in seen
        return pictures

    assert [p.image.size for p in asyncio.run(main())] == [(8 + i, 8) for i in range(5)]
    bad = [*parts[:2], from_base64("bm90IGFuIGltYWdl", "images[2]"), *parts[3:]]
    with pytest.raises(ImageError, match="images\\[2\\]"):
        asyncio.run(decode_all(bad))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode())))
def test_any_text_is_a_picture_or_an_image_error(text):
    try:
        part = from_data_url(text, "input[0].content[0].image_url")
        decode(part)
    except ImageError as e:
        assert str(e).startswith("input[0].content[0].image_url: ")


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.integers(0, 200))
def test_any_damage_to_a_real_png_is_a_picture_or_an_image_error(noise, at):
    whole = bytearray(base64.b64decode(encoded(gradient(16, 16), "PNG")))
    whole[at : at + len(noise)] = noise
    try:
        picture = decode(from_base64(base64.b64encode(bytes(whole)).decode(), "images[0]")).image
    except ImageError as e:
        assert str(e).startswith("images[0]: ")
    else:
        assert picture.mode == "RGB"


def test_a_web_url_is_refused_unless_fetching_is_on_then_fetched_within_its_bounds():
    """Off (the default), a part naming a web URL is refused saying how to turn fetching on; on, the
    file is fetched (redirects followed), and a 404, a file past MAX_IMAGE_BYTES, a server that
    does not answer, a page that is no image each an ImageError naming the part."""
    from aiohttp import web

    from devkit.pictures import png

    picture = png(gradient(20, 10))

    async def main():
        async def cat(request):
            return web.Response(body=picture, content_type="image/png")

        async def moved(request):
            raise web.HTTPFound("/cat.png")

        async def page(request):
            return web.Response(text="<html>no picture</html>", content_type="text/html")

        app = web.Application()
        for path, handler in (("/cat.png", cat), ("/moved", moved), ("/page", page)):
            app.router.add_get(path, handler)

        async def huge(request):
            r = web.StreamResponse()
            await r.prepare(request)
            for _ in range(14):  # no length declared: cut off as it comes
                await r.write(b"\0" * 2**20)
            return r

        app.router.add_get("/huge", huge)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            part = images.from_web(base + "/cat.png", "messages[0].content[1].image_url")
            with pytest.raises(ImageError, match=r"^messages\[0\].content\[1\].image_url: ringd does not fetch images from the web unless told to: set fetch_image_urls: true"):
                await decode_all([part])
            (got,) = await decode_all([images.from_web(base + "/moved", "x")], fetch_urls=True)
            assert got.raw == picture and got.image.size == (20, 10)
            for path, said in (("/nothing", "answered HTTP 404"), ("/huge", "is over 12 MiB"), ("/page", "not an image in a format")):
                with pytest.raises(ImageError, match=f"^images\\[1\\]: .*{said}"):
                    await decode_all([images.from_web(base + path, "images[1]")], fetch_urls=True)
            with pytest.raises(ImageError, match=r"^images\[0\]: could not fetch http://127.0.0.1:9/"):
                await decode_all([images.from_web("http://127.0.0.1:9/x.png", "images[0]")], fetch_urls=True)
        finally:
            await runner.cleanup()

    asyncio.run(main())
