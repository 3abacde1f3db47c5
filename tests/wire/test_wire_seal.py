"""Sealed frames: round trips in both modes, and any change to the byte stream a FrameError."""

import hashlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wire.frames import (
    DEFAULT_LIMITS,
    HEADER,
    HEADER_BYTES,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameError,
    Limits,
    MsgType,
    encode_frame,
)
from wire.seal import MAC_BYTES, TAG_BYTES, IntegrityError, Session, derive_session

from test_wire_frames import feed_through_buffers, frames

SECRET = b"seal-test-secret"
# Small enough that zero padding of one whole frame forces any frame in flight
# to complete: a length bit flipped upwards cannot leave the decoder waiting.
LIMITS = Limits(max_descriptor_bytes=512, max_payload_bytes=1024)
PADDING = bytes(HEADER_BYTES + LIMITS.max_descriptor_bytes + LIMITS.max_payload_bytes + MAC_BYTES)

modes = pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])


def sessions(encrypt: bool, transcript: bytes = b"transcript") -> tuple[Session, Session]:
    """Both ends of one connection: (initiator's, responder's)."""
    return (
        derive_session(SECRET, transcript, initiator=True, encrypt=encrypt),
        derive_session(SECRET, transcript, initiator=False, encrypt=encrypt),
    )


def sealed(session: Session, fs: list[Frame], limits: Limits = LIMITS) -> list[bytes]:
    """Each frame's bytes on the wire, sealed in order."""
    return [b"".join(bytes(b) for b in encode_frame(f, limits, session.sealer)) for f in fs]


def decode(session: Session, data: bytes, draw=None) -> list[Frame]:
    decoder = FrameDecoder(LIMITS, session.opener)
    if draw is None:
        return decoder.feed(data)
    return feed_through_buffers(decoder, data, draw)


def decode_until_error(session: Session, data: bytes) -> tuple[list[Frame], FrameError | None]:
    """Frames delivered before the decoder failed, and why it failed (None: it did not)."""
    decoder = FrameDecoder(LIMITS, session.opener)
    got, pos = [], 0
    try:
        # Part by part, as a BufferedProtocol reads: every frame handed on before the error is seen.
        while pos < len(data):
            buf = decoder.get_buffer()
            n = min(len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            got += decoder.buffer_updated(n)
    except FrameError as e:
        return got, e
    return got, None


small_frames = frames.filter(
    lambda f: len(encode_frame(f)[0]) - HEADER_BYTES <= LIMITS.max_descriptor_bytes
)


@settings(max_examples=60)
@given(st.booleans(), st.lists(small_frames, max_size=5), st.data())
def test_sealed_frames_round_trip_in_any_chunking(encrypt, fs, data):
    ours, theirs = sessions(encrypt)
    got = decode(theirs, b"".join(sealed(ours, fs)), data.draw)
    assert got == fs
    assert [f.seq for f in got] == list(range(len(fs)))


@modes
def test_trailer_and_what_travels_in_the_clear(encrypt):
    ours, _ = sessions(encrypt)
    frame = Frame(MsgType.CONTROL, 7, {"secret-ish": "descriptor"}, b"payload bytes")
    [data] = sealed(ours, [frame])
    plain = b"".join(bytes(b) for b in encode_frame(frame, LIMITS))
    assert len(data) == len(plain) + (TAG_BYTES if encrypt else MAC_BYTES)
    assert data[:HEADER_BYTES] == plain[:HEADER_BYTES]  # the header is always readable
    assert (b"secret-ish" in data, b"payload bytes" in data) == (not encrypt, not encrypt)


def test_integrity_mode_sends_the_payload_uncopied():
    ours, theirs = sessions(False)
    payload = bytearray(b"x" * 5000)
    frame = Frame(MsgType.CONTROL, 1, {"a": 1}, payload)
    head, body, mac = encode_frame(frame, DEFAULT_LIMITS, ours.sealer)
    assert body.obj is payload
    assert len(mac) == MAC_BYTES
    [frame] = FrameDecoder(DEFAULT_LIMITS, theirs.opener).feed(bytes(head) + bytes(body) + mac)
    # Received, a view of the one buffer the frame's body was read into: not copied out of it.
    assert frame.payload == payload and isinstance(frame.payload.obj, bytearray)


@modes
def test_same_frame_twice_seals_differently(encrypt):
    """The sequence number is in every MAC and nonce: no two sealed frames are alike."""
    ours, _ = sessions(encrypt)
    frame = Frame(MsgType.PING, descriptor={"n": 1})
    first, second = sealed(ours, [frame, frame])
    assert first[:HEADER_BYTES] == second[:HEADER_BYTES] and first != second


@modes
def test_keys_differ_per_direction_and_per_connection(encrypt):
    a, b = sessions(encrypt)
    other_a, other_b = sessions(encrypt, transcript=b"another connection's transcript")
    frame = Frame(MsgType.PING, descriptor={"n": 1})
    assert decode(b, sealed(a, [frame])[0]) == [frame]
    # Reflected to its sender, or taken to another connection: fails.
    for opener_side, sealer_side in ((a, sessions(encrypt)[0]), (other_b, sessions(encrypt)[0])):
        with pytest.raises(IntegrityError, match="PING frame failed its"):
            decode(opener_side, sealed(sealer_side, [frame])[0])
    # A wrong secret derives other keys from the same transcript.
    stranger = derive_session(b"guess", b"transcript", initiator=True, encrypt=encrypt)
    with pytest.raises(IntegrityError):
        decode(b, sealed(stranger, [frame])[0])


def test_unsealed_frame_into_a_sealed_stream_fails():
    _, theirs = sessions(False)
    plain = b"".join(bytes(b) for b in encode_frame(Frame(MsgType.PING), LIMITS))
    _, error = decode_until_error(theirs, plain + PADDING)
    assert isinstance(error, IntegrityError)


@settings(max_examples=300)
@given(st.booleans(), st.lists(small_frames, min_size=1, max_size=3), st.data())
@example(False, [Frame(MsgType.PING)], None)
def test_any_flipped_bit_fails_the_frame(encrypt, fs, data):
    """Header, descriptor, payload or trailer: one bit changed is a FrameError, and no frame."""
    ours, theirs = sessions(encrypt)
    wire = sealed(ours, fs)
    if data is None:  # the @example: the lowest bit of the first header byte
        index, bit = 0, 0
    else:
        index = data.draw(st.integers(0, len(fs) - 1))
        bit = data.draw(st.integers(0, 8 * len(wire[index]) - 1))
    flipped = bytearray(wire[index])
    flipped[bit // 8] ^= 1 << (bit % 8)
    stream = b"".join(wire[:index]) + bytes(flipped) + b"".join(wire[index + 1 :]) + PADDING
    got, error = decode_until_error(theirs, stream)
    assert isinstance(error, FrameError)
    assert got == fs[:index]


@modes
def test_every_bit_of_one_frame_is_covered(encrypt):
    """Exhaustively, for one small frame: each of its bits, flipped, fails it."""
    ours, _ = sessions(encrypt)
    [data] = sealed(ours, [Frame(MsgType.CONTROL, 9, {"tensor": [1, 2]}, bytes(range(40)))])
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        decoder = FrameDecoder(LIMITS, sessions(encrypt)[1].opener)
        with pytest.raises(FrameError):
            decoder.feed(bytes(flipped) + PADDING)


def test_flipped_trailer_and_payload_name_the_integrity_check():
    ours, theirs = sessions(False)
    [data] = sealed(ours, [Frame(MsgType.CONTROL, 1, {"a": 1}, b"p" * 100)])
    for pos in (HEADER_BYTES + 3, len(data) - 50, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        _, error = decode_until_error(theirs, bytes(bad))
        assert isinstance(error, IntegrityError) and "frame 0 of this link" in str(error)


def replay(w, i, _):
    return [*w[: i + 1], w[i], *w[i + 1 :]]


def swap(w, i, _):
    return [*w[:i], w[i + 1], w[i], *w[i + 2 :]]


def drop(w, i, _):
    return [*w[:i], *w[i + 1 :]]


def inject(w, i, junk):
    return [*w[:i], junk, *w[i:]]


@settings(max_examples=200)
@given(
    st.booleans(),
    st.lists(small_frames, min_size=3, max_size=5),
    st.sampled_from([replay, swap, drop, inject]),
    st.data(),
)
def test_replayed_swapped_dropped_or_injected_frames_fail(encrypt, fs, change, data):
    ours, theirs = sessions(encrypt)
    wire = sealed(ours, fs)
    # For swap and drop a later frame must follow; the stream's end is not a frame.
    i = data.draw(st.integers(0, len(fs) - 2))
    junk = data.draw(
        st.binary(min_size=1, max_size=80)
        | st.sampled_from(
            [
                sealed(ours, [Frame(MsgType.PING)])[0],  # ours, but out of sequence
                sealed(sessions(encrypt, b"other")[0], [Frame(MsgType.PING)])[0],
                b"".join(bytes(b) for b in encode_frame(Frame(MsgType.PING), LIMITS)),
            ]
        )
    )
    got, error = decode_until_error(theirs, b"".join(change(wire, i, junk)) + PADDING)
    assert isinstance(error, FrameError), f"{change.__name__} at {i} went unnoticed"
    assert got == fs[: len(got)] and len(got) <= i + 1


@settings(max_examples=300)
@given(
    st.booleans(),
    st.lists(small_frames, max_size=4),
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 40), st.binary(max_size=40)), max_size=4
    ),
    st.data(),
)
def test_mutated_streams_yield_only_genuine_frames_or_frame_errors(encrypt, fs, edits, data):
    """Splice arbitrary bytes anywhere: frames that come out are the sender's, in order."""
    ours, theirs = sessions(encrypt)
    stream = bytearray(b"".join(sealed(ours, fs)))
    for pos, cut, insert in edits:
        pos = min(pos, len(stream))
        stream[pos : pos + cut] = insert
    try:
        got = decode(theirs, bytes(stream), data.draw)
    except FrameError:
        return
    assert got == fs[: len(got)]


@given(st.binary(max_size=400), st.booleans())
def test_random_bytes_after_the_handshake_are_frame_errors(junk, encrypt):
    _, theirs = sessions(encrypt)
    try:
        got = decode(theirs, junk)
    except FrameError:
        return
    assert got == []


@modes
def test_decoder_is_dead_after_a_bad_seal(encrypt):
    ours, theirs = sessions(encrypt)
    first, second = sealed(ours, [Frame(MsgType.PING), Frame(MsgType.PONG)])
    decoder = FrameDecoder(LIMITS, theirs.opener)
    with pytest.raises(IntegrityError):
        decoder.feed(second)  # frame 1 arrived where frame 0 was due
    with pytest.raises(FrameError, match="earlier error"):
        decoder.feed(first)


def test_big_header_fails_before_the_mac_and_before_allocating():
    """A sealed stream still checks declared lengths first: no MAC is worth 4 GiB."""
    _, theirs = sessions(True)
    decoder = FrameDecoder(LIMITS, theirs.opener)
    with pytest.raises(FrameError, match="limit of 1024 bytes"):
        decoder.feed(HEADER.pack(b"RNGD", PROTOCOL_VERSION, MsgType.FORWARD, 0, 0, 0, 2**32 - 1))
    assert decoder.payload_capacity == 0


@modes
def test_a_sealed_frame_is_two_reads_its_header_then_the_rest(encrypt):
    """Each read is a socket read and a callback on the event loop, per frame per hop: after
    the header, one view takes descriptor, payload and MAC (or tag) at once, and nothing past
    them. The decoder's own buffer holds only a header: the body is the frame's."""
    ours, theirs = sessions(encrypt)
    frame = Frame(MsgType.FORWARD, 5, b"rows", bytearray(b"h" * 300))
    data = sealed(ours, [frame])[0]
    decoder = FrameDecoder(DEFAULT_LIMITS, theirs.opener)
    assert decoder.scratch_bytes == HEADER_BYTES  # not a 64 KiB descriptor's room
    sizes = []
    while data:
        view = decoder.get_buffer(-1)
        n = min(len(view), len(data))
        sizes.append(len(view))
        view[:n], data = data[:n], data[n:]
        out = decoder.buffer_updated(n)
    assert sizes == [HEADER_BYTES, 4 + 300 + (TAG_BYTES if encrypt else MAC_BYTES)]
    assert out == [frame]


def test_opener_only_changes_between_frames():
    ours, theirs = sessions(False)
    decoder = FrameDecoder(LIMITS)
    decoder.feed(b"RNG")
    with pytest.raises(RuntimeError, match="between frames"):
        decoder.opener = theirs.opener


def test_session_keys_follow_the_transcript():
    """Salted with the transcript's hash: two connections never share keys."""
    a1, _ = sessions(False, hashlib.sha256(b"1").digest())
    a2, _ = sessions(False, hashlib.sha256(b"2").digest())
    frame = Frame(MsgType.PING)
    assert sealed(a1, [frame]) != sealed(a2, [frame])


def _direction_key(label: bytes, mode: bytes, transcript: bytes = b"transcript") -> bytes:
    """The initiator's sending key, derived as wire.seal derives it, under ``label`` and ``mode``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    salt = hashlib.sha256(transcript).digest()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=label + mode + b"initiator->responder").derive(SECRET)


def test_integrity_trailer_is_keyed_blake3_of_seq_header_descriptor_and_payload():
    """Protocol 5's MAC, computed here apart from wire.seal: keyed BLAKE3 under the session's key."""
    from blake3 import blake3

    from wire.labels import SESSION_KEYS

    ours, _ = sessions(False)
    frames_ = [Frame(MsgType.CONTROL, 3, {"a": 1}, b"payload" * 9), Frame(MsgType.PING)]
    key = _direction_key(SESSION_KEYS, b"blake3-keyed|")
    for seq, (frame, data) in enumerate(zip(frames_, sealed(ours, frames_))):
        body, trailer = data[:-MAC_BYTES], data[-MAC_BYTES:]
        assert trailer == blake3(seq.to_bytes(8, "little") + body, key=key).digest()


def test_a_protocol_4_hmac_trailer_does_not_open():
    """A frame sealed as protocol 4 sealed it (HMAC-SHA256 under the v2 label's key) fails here, so
    two versions never talk past their handshake (which refuses the mismatch first)."""
    import hmac

    frame = Frame(MsgType.CONTROL, 3, {"a": 1}, b"payload")
    body = b"".join(bytes(b) for b in encode_frame(frame, LIMITS))
    old = _direction_key(b"ringd-session-v2|", b"hmac-sha256|")
    trailer = hmac.new(old, (0).to_bytes(8, "little") + body, hashlib.sha256).digest()
    _, theirs = sessions(False)
    _, error = decode_until_error(theirs, body + trailer + PADDING)
    assert isinstance(error, IntegrityError)


@settings(max_examples=200)
@given(st.lists(small_frames, min_size=1, max_size=3), st.data())
def test_any_changed_byte_after_the_header_is_an_integrity_error(fs, data):
    """Descriptor, payload or MAC: any byte replaced by another fails the MAC (the header's bytes
    may fail its checks first, as a FrameError: test_any_flipped_bit_fails_the_frame)."""
    ours, theirs = sessions(False)
    wire = sealed(ours, fs)
    index = data.draw(st.integers(0, len(fs) - 1))
    pos = data.draw(st.integers(HEADER_BYTES, len(wire[index]) - 1))
    changed = bytearray(wire[index])
    changed[pos] ^= data.draw(st.integers(1, 255))
    got, error = decode_until_error(theirs, b"".join(wire[:index]) + bytes(changed) + b"".join(wire[index + 1 :]) + PADDING)
    assert isinstance(error, IntegrityError), error
    assert got == fs[:index]
