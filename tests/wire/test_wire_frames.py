"""Frame codec: round trips, arbitrary chunking, and every malformed input a FrameError."""

import dataclasses
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.frames import (
    RAW_TYPES,
    DEFAULT_LIMITS,
    HANDSHAKE_LIMITS,
    INFO_LIMITS,
    HEADER,
    MAGIC,
    MAX_DESCRIPTOR_BYTES,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameError,
    Limits,
    MsgType,
    encode_frame,
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
frames = st.builds(
    Frame,
    type=st.sampled_from(MsgType),
    request_id=st.integers(0, 2**64 - 1),
    descriptor=st.dictionaries(st.text(max_size=8), json_values, max_size=5),
    payload=st.binary(max_size=300),
).flatmap(
    # RAW_TYPES carry bytes the layer above lays out: any bytes, kept as they are.
    lambda f: st.binary(max_size=100).map(lambda d: dataclasses.replace(f, descriptor=d)) if f.type in RAW_TYPES else st.just(f)
)


def wire_bytes(*fs: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    return b"".join(bytes(buf) for f in fs for buf in encode_frame(f, limits))


def header(
    magic=MAGIC,
    version=PROTOCOL_VERSION,
    msg_type=MsgType.PING,
    flags=0,
    request_id=0,
    descriptor_len=0,
    payload_len=0,
) -> bytes:
    return HEADER.pack(magic, version, msg_type, flags, request_id, descriptor_len, payload_len)


def feed_through_buffers(decoder: FrameDecoder, data: bytes, draw) -> list[Frame]:
    """The BufferedProtocol path: fill get_buffer() views, report with buffer_updated().

    `draw(strategy)` picks each sizehint and how many bytes "the kernel" delivers.
    """
    out, pos = [], 0
    while pos < len(data):
        buf = decoder.get_buffer(draw(sizehints))
        assert len(buf) >= 1
        n = min(len(buf), len(data) - pos, draw(deliveries))
        buf[:n] = data[pos : pos + n]
        pos += n
        out += decoder.buffer_updated(n)
        assert decoder.payload_capacity <= decoder.limits.max_payload_bytes
    return out


# Listed first is what Hypothesis shrinks to: big reads keep minimal examples small.
sizehints = st.sampled_from([-1, 0, 1, 64, 65536])
deliveries = st.sampled_from([4096, 1, 2, 3, 23, 24, 25, 100])


# Lists of frames with payloads up to a few MiB: on a loaded two-core machine generating them
# can pass Hypothesis's one-second budget, which says nothing of the code under test.
@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, max_size=6))
def test_frames_round_trip(fs):
    assert FrameDecoder().feed(wire_bytes(*fs)) == fs


@settings(max_examples=100)
@given(st.lists(frames, min_size=1, max_size=6), st.data())
def test_any_chunking_decodes_the_same(fs, data):
    stream = wire_bytes(*fs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    decoder = FrameDecoder()
    got = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += decoder.feed(stream[start:end])
    assert got == fs

    assert feed_through_buffers(FrameDecoder(), stream, data.draw) == fs


@settings(max_examples=60)
@given(st.lists(frames, min_size=1, max_size=4), st.data())
def test_truncated_stream_yields_only_whole_frames(fs, data):
    stream = wire_bytes(*fs)
    cut = data.draw(st.integers(0, len(stream) - 1))
    ends = [len(wire_bytes(*fs[: i + 1])) for i in range(len(fs))]
    whole = sum(end <= cut for end in ends)
    assert FrameDecoder().feed(stream[:cut]) == fs[:whole]


def test_encode_passes_the_payload_through_uncopied():
    payload = bytearray(b"x" * 1000)
    head, body = encode_frame(Frame(MsgType.CONTROL, 1, {"a": 1}, payload))
    assert body.obj is payload and body.format == "B"
    assert (
        head
        == header(msg_type=MsgType.CONTROL, request_id=1, descriptor_len=7, payload_len=1000)
        + b'{"a":1}'
    )
    # An empty descriptor is zero bytes, an empty payload no buffer at all.
    assert encode_frame(Frame(MsgType.PING)) == [header()]


def test_encode_casts_typed_memoryviews_to_bytes():
    words = memoryview(struct.pack("<4I", 1, 2, 3, 4)).cast("I")
    _, body = encode_frame(Frame(MsgType.CONTROL, payload=words))
    assert body.format == "B" and body.nbytes == 16
    assert FrameDecoder().feed(wire_bytes(Frame(MsgType.CONTROL, payload=words)))[0].payload == (
        struct.pack("<4I", 1, 2, 3, 4)
    )


@pytest.mark.parametrize(
    "frame, limits, needle",
    [
        (Frame(99), DEFAULT_LIMITS, "unknown message type 99"),
        (Frame(MsgType.PING, flags=1), DEFAULT_LIMITS, "flags=0x0001"),
        (Frame(MsgType.PING, request_id=-1), DEFAULT_LIMITS, "request_id=-1"),
        (Frame(MsgType.PING, request_id=2**64), DEFAULT_LIMITS, "not a u64"),
        (Frame(MsgType.PING, descriptor=[1]), DEFAULT_LIMITS, "must be a dict"),
        (Frame(MsgType.PING, descriptor={"x": float("nan")}), DEFAULT_LIMITS, "JSON"),
        (Frame(MsgType.PING, descriptor={"x": object()}), DEFAULT_LIMITS, "JSON"),
        (Frame(MsgType.HELLO, descriptor={"x": "a" * 2000}), HANDSHAKE_LIMITS, "limit of 1024"),
        (Frame(MsgType.INFO, descriptor={"x": "a" * 5000}), INFO_LIMITS, "limit of 4096"),
        (Frame(MsgType.HELLO, payload=b"x"), HANDSHAKE_LIMITS, "limit of 0 bytes"),
    ],
)
def test_encode_rejects(frame, limits, needle):
    with pytest.raises(FrameError, match=needle):
        encode_frame(frame, limits)


@pytest.mark.parametrize(
    "head, needle",
    [
        (header(magic=b"GET "), "bad magic b'GET '"),
        (header(version=1), "protocol version 1 is not supported"),
        (header(version=PROTOCOL_VERSION + 1), f"protocol version {PROTOCOL_VERSION + 1}"),
        (header(msg_type=0), "unknown message type 0"),
        (header(msg_type=200), "unknown message type 200"),
        (header(flags=0x8000), "flags=0x8000"),
        (header(descriptor_len=MAX_DESCRIPTOR_BYTES + 1), f"limit of {MAX_DESCRIPTOR_BYTES}"),
        (header(payload_len=MAX_PAYLOAD_BYTES + 1), f"limit of {MAX_PAYLOAD_BYTES}"),
        (header(payload_len=2**32 - 1), "4294967295 bytes"),
    ],
)
def test_bad_header_fails_before_allocating(head, needle):
    decoder = FrameDecoder()
    with pytest.raises(FrameError, match=needle):
        decoder.feed(head)
    assert decoder.payload_capacity == 0
    # A dead decoder stays dead: the stream is out of sync.
    with pytest.raises(FrameError, match="earlier error"):
        decoder.feed(wire_bytes(Frame(MsgType.PING)))
    with pytest.raises(FrameError, match="earlier error"):
        decoder.get_buffer(-1)


@pytest.mark.parametrize(
    "descriptor, needle",
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"{'a': 1}", "not UTF-8 JSON"),
        (b'{"a": NaN}', "NaN is not valid JSON"),
        (b'{"a": Infinity}', "Infinity is not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'"text"', "must be a JSON object, got str"),
        (b"[" * 30000 + b"]" * 30000, "not UTF-8 JSON"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not UTF-8 JSON"),
    ],
)
def test_bad_descriptor(descriptor, needle):
    data = header(msg_type=MsgType.CONTROL, descriptor_len=len(descriptor)) + descriptor
    with pytest.raises(FrameError, match=f"CONTROL frame descriptor .*{needle}"):
        FrameDecoder().feed(data)


def test_handshake_limits_refuse_payloads_and_big_descriptors():
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    with pytest.raises(FrameError, match="payload of 1 bytes, over the limit of 0"):
        decoder.feed(header(msg_type=MsgType.FORWARD, payload_len=1))
    with pytest.raises(FrameError, match="descriptor of 1025 bytes"):
        FrameDecoder(HANDSHAKE_LIMITS).feed(header(msg_type=MsgType.HELLO, descriptor_len=1025))


def test_limits_change_between_frames():
    """The stream relaxes limits right after the handshake's last frame."""
    big = Frame(MsgType.CONTROL, 3, {"t": 1}, b"y" * 5000)
    data = wire_bytes(Frame(MsgType.PROOF, descriptor={"mac": "00"}), big)
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    first = []
    while not first:  # byte by byte up to the end of PROOF: nothing of `big` is read yet
        first = decoder.feed(data[:1])
        data = data[1:]
    decoder.limits = DEFAULT_LIMITS
    assert decoder.feed(data) == [big]


def test_scratch_is_sized_for_the_limits_in_force():
    """A stranger still in the handshake costs about 1 KiB, not a 64 KiB descriptor buffer."""
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    assert decoder.scratch_bytes <= 2 * 1024
    decoder.limits = INFO_LIMITS
    assert INFO_LIMITS.max_descriptor_bytes < decoder.scratch_bytes <= 5 * 1024
    decoder.limits = DEFAULT_LIMITS
    assert decoder.scratch_bytes >= MAX_DESCRIPTOR_BYTES
    # Grown, it decodes the big descriptor it was grown for.
    big = Frame(MsgType.CONTROL, descriptor={"x": "a" * (MAX_DESCRIPTOR_BYTES - 10)})
    assert decoder.feed(wire_bytes(big)) == [big]


def test_limits_grown_mid_header_keep_the_bytes_already_read():
    frame = Frame(MsgType.CONTROL, 5, {"k": "v" * 2000})
    data = wire_bytes(frame)
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    assert decoder.feed(data[:10]) == []
    decoder.limits = DEFAULT_LIMITS  # applies to this header: it is not complete yet
    assert decoder.feed(data[10:]) == [frame]


def test_limits_cannot_loosen_the_protocol_maxima():
    with pytest.raises(ValueError, match="max_payload_bytes"):
        Limits(max_payload_bytes=MAX_PAYLOAD_BYTES + 1)
    with pytest.raises(ValueError, match="max_descriptor_bytes"):
        Limits(max_descriptor_bytes=-1)


small_limits = st.builds(Limits, st.integers(0, 200), st.integers(0, 2000))
fuzz_headers = st.builds(
    header,
    magic=st.sampled_from([MAGIC, MAGIC, b"RNGE", b"\0\0\0\0"]),
    version=st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 255]),
    msg_type=st.integers(0, 255),
    flags=st.sampled_from([0, 0, 1, 0x8000]),
    request_id=st.integers(0, 2**64 - 1),
    descriptor_len=st.integers(0, 2**32 - 1) | st.integers(0, 300),
    payload_len=st.integers(0, 2**32 - 1) | st.integers(0, 3000),
)


@settings(max_examples=300)
@given(small_limits, st.lists(fuzz_headers | st.binary(max_size=200), max_size=8), st.data())
def test_arbitrary_input_decodes_or_raises_frame_error_within_limits(limits, parts, data):
    decoder = FrameDecoder(limits)
    try:
        got = feed_through_buffers(decoder, b"".join(parts), data.draw)
    except FrameError:
        return
    assert all(len(frame.payload) <= limits.max_payload_bytes for frame in got)
