"""ringd.ring.media: a prompt's images as they travel to the first stage, and as the prefix cache keys them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.ring.media import MAX_IMAGE_BYTES, MAX_IMAGES, Media, prefix_key
from wire.frames import Frame, FrameDecoder, FrameError, MsgType, encode_frame

IMAGE = 9  # the image token of these tests


@given(st.text(max_size=200), st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=MAX_IMAGES), st.integers(0, 2**40))
def test_media_goes_over_the_wire_and_comes_back_whole(text, images, term):
    media = Media(7, term, text, tuple(images))
    (got,) = FrameDecoder().feed(b"".join(bytes(b) for b in encode_frame(media.frame())))
    assert Media.parse(got) == media


@given(st.dictionaries(st.sampled_from(["term", "text", "images", "other"]), st.one_of(st.integers(-5, 2**25), st.lists(st.integers(-5, 2**25), max_size=20), st.text(max_size=5), st.none())), st.binary(max_size=200))
def test_any_descriptor_and_payload_is_media_or_a_frame_error(descriptor, payload):
    try:
        media = Media.parse(Frame(MsgType.MEDIA, 3, descriptor, payload))
    except FrameError:
        return
    assert len(payload) == len(media.text.encode()) + sum(map(len, media.images))


def test_what_a_lying_peer_declares_is_refused_before_it_is_kept():
    ok = Media(1, 2, "hi", (b"abc",)).frame()
    cases = [
        ({**ok.descriptor, "images": [MAX_IMAGE_BYTES + 1]}, "image lengths"),
        ({**ok.descriptor, "images": [1] * (MAX_IMAGES + 1)}, "1 to 16 lengths"),
        ({**ok.descriptor, "images": []}, "1 to 16 lengths"),
        ({**ok.descriptor, "text": 3}, "payload is 5 bytes; its descriptor declares 6"),
        ({**ok.descriptor, "term": "2"}, "term"),
    ]
    for descriptor, said in cases:
        with pytest.raises(FrameError, match=said):
            Media.parse(Frame(MsgType.MEDIA, 1, descriptor, ok.payload))
    with pytest.raises(FrameError, match="not UTF-8"):
        Media.parse(Frame(MsgType.MEDIA, 1, {"term": 2, "text": 2, "images": [3]}, b"\xff\xfeabc"))


def test_a_prefix_is_shared_through_an_image_only_when_it_is_the_same_file():
    ids = [1, 2, IMAGE, IMAGE, IMAGE, 3, IMAGE, IMAGE, 4]
    a, b = b"first picture", b"second picture"
    key = prefix_key(ids, IMAGE, (a, b))
    assert [k for k, t in zip(key, ids) if t != IMAGE] == [1, 2, 3, 4]  # text keeps its ids
    assert all(k < 0 for k, t in zip(key, ids) if t == IMAGE) and len(set(key[2:5] + key[6:8])) == 5
    assert prefix_key(ids, IMAGE, (a, b)) == key  # the same files: the same key
    other = prefix_key(ids, IMAGE, (a, b"another"))
    assert other[:6] == key[:6] and other[6] != key[6]  # shared up to the image that differs
    assert prefix_key(ids, IMAGE, (b, a))[2] != key[2]
    # Runs that are not one an image (two images' tokens side by side): every position stands for all the files.
    side = prefix_key([1, IMAGE, IMAGE, 2], IMAGE, (a, b))
    assert side != prefix_key([1, IMAGE, IMAGE, 2], IMAGE, (a, b"another")) and side[0] == 1 and side[3] == 2
    assert prefix_key([1, 2, 3], IMAGE, ()) == (1, 2, 3)


@given(st.lists(st.sampled_from([1, 2, IMAGE]), max_size=40), st.lists(st.binary(max_size=8), max_size=4))
def test_a_key_has_the_prompt_s_length_and_no_token_id(ids, files):
    key = prefix_key(ids, IMAGE, tuple(files))
    assert len(key) == len(ids)
    assert all((k < 0) == (t == IMAGE) for k, t in zip(key, ids)) or not files
