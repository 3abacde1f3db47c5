"""The ring's frame format: encode frames to buffers, decode bytes to frames.

Sans-I/O: this module never touches a socket, a clock or MLX. It turns a Frame
into the buffers to write and an incoming byte stream back into Frames, checking
every declared length against a named limit before anything is allocated. What
the descriptor keys mean and what the payload holds (tensor bytes, usually) is the
business of the layers above; here a descriptor is any small JSON object and a
payload is opaque bytes.

A frame on the wire:

    header      24 bytes, little-endian: magic b"RNGD", protocol version (u8),
                message type (u8), flags (u16), request id (u64),
                descriptor length (u32), payload length (u32)
    descriptor  UTF-8 JSON object, compact; zero bytes stand for {}
    payload     raw bytes
"""

import enum
import json
import struct
from dataclasses import dataclass, field

MAGIC = b"RNGD"
PROTOCOL_VERSION = 1

HEADER = struct.Struct("<4sBBHQII")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 24, "the header layout is part of the protocol"

# No flags are defined yet. Every bit is reserved so that a peer cannot set one
# whose meaning this version does not know and have it silently ignored.
KNOWN_FLAGS = 0x0000

MAX_REQUEST_ID = 2**64 - 1  # the header's request id field is a u64

# Descriptors are small metadata (dtype, shape, sampling parameters, a plan);
# one larger than this is a bug or an attack, not a real message.
MAX_DESCRIPTOR_BYTES = 64 * 1024
# The largest tensor frame: a 2048-token prefill chunk of hidden size 16384 in
# float32 is 128 MiB. 512 MiB leaves headroom and bounds one allocation per frame.
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024


class MsgType(enum.IntEnum):
    HELLO = 1  # handshake: who I am, my nonce
    PROOF = 2  # handshake: HMAC over both hellos
    PING = 3  # heartbeat
    PONG = 4  # heartbeat answer
    PLAN = 5  # leader -> node: ring order and layer ranges
    LOADED = 6  # node -> leader: plan's layers are loaded
    FORWARD = 7  # tokens or hidden state of one request step
    TOKEN = 8  # last stage -> leader: a sampled token
    RELEASE = 9  # free a request's caches
    ERROR = 10  # a stage failed a request
    STATUS = 11
    STATUS_REPLY = 12
    CONTROL = 13  # misc control messages, e.g. membership gossip


class FrameError(Exception):
    """Malformed frame. The stream it came from is out of sync: drop the connection."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one frame's declared lengths, checked before allocating."""

    max_descriptor_bytes: int = MAX_DESCRIPTOR_BYTES
    max_payload_bytes: int = MAX_PAYLOAD_BYTES

    def __post_init__(self):
        # Limits may tighten the protocol's maxima, never loosen them: the
        # decoder's scratch buffer is sized for MAX_DESCRIPTOR_BYTES.
        if not 0 <= self.max_descriptor_bytes <= MAX_DESCRIPTOR_BYTES:
            raise ValueError(
                f"max_descriptor_bytes={self.max_descriptor_bytes} must be in "
                f"[0, {MAX_DESCRIPTOR_BYTES}]"
            )
        if not 0 <= self.max_payload_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"max_payload_bytes={self.max_payload_bytes} must be in [0, {MAX_PAYLOAD_BYTES}]"
            )


DEFAULT_LIMITS = Limits()
# Before a peer has authenticated it may only send HELLO and PROOF: a few
# hundred bytes of descriptor, never a payload.
HANDSHAKE_LIMITS = Limits(max_descriptor_bytes=1024, max_payload_bytes=0)


@dataclass(frozen=True)
class Frame:
    type: MsgType
    request_id: int = 0
    descriptor: dict = field(default_factory=dict)
    payload: bytes | bytearray | memoryview = b""
    flags: int = 0


def encode_frame(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> list:
    """The buffers to write, in order: header+descriptor, then the payload if any.

    The payload is passed on as a memoryview of the caller's own buffer, never
    copied, so the caller must not modify it until the transport has sent it.
    """
    try:
        msg_type = MsgType(frame.type)
    except ValueError:
        raise FrameError(f"cannot encode unknown message type {frame.type!r}") from None
    name = msg_type.name
    if frame.flags & ~KNOWN_FLAGS:
        raise FrameError(f"{name} frame has unknown flag bits set: flags=0x{frame.flags:04x}")
    if not isinstance(frame.request_id, int) or not 0 <= frame.request_id <= MAX_REQUEST_ID:
        raise FrameError(f"{name} frame request_id={frame.request_id!r} is not a u64")
    if not isinstance(frame.descriptor, dict):
        raise FrameError(
            f"{name} frame descriptor must be a dict, got {type(frame.descriptor).__name__}"
        )
    try:
        descriptor = (
            json.dumps(frame.descriptor, separators=(",", ":"), allow_nan=False).encode()
            if frame.descriptor
            else b""
        )
    except (TypeError, ValueError) as e:
        raise FrameError(f"{name} frame descriptor is not JSON-serializable: {e}") from e
    if len(descriptor) > limits.max_descriptor_bytes:
        raise FrameError(
            f"{name} frame descriptor is {len(descriptor)} bytes, over the limit of "
            f"{limits.max_descriptor_bytes} bytes"
        )
    payload = memoryview(frame.payload)
    if payload.nbytes > limits.max_payload_bytes:
        raise FrameError(
            f"{name} frame payload is {payload.nbytes} bytes, over the limit of "
            f"{limits.max_payload_bytes} bytes"
        )
    header = HEADER.pack(
        MAGIC,
        PROTOCOL_VERSION,
        msg_type,
        frame.flags,
        frame.request_id,
        len(descriptor),
        payload.nbytes,
    )
    if payload.nbytes == 0:
        return [header + descriptor]
    if payload.format != "B" or payload.ndim != 1:
        payload = payload.cast("B")
    return [header + descriptor, payload]


class _State(enum.Enum):
    HEADER = enum.auto()
    DESCRIPTOR = enum.auto()
    PAYLOAD = enum.auto()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class FrameDecoder:
    """Incremental decoder: bytes in, complete Frames out.

    Feed it with `feed(data)`, or zero-copy in the style of
    asyncio.BufferedProtocol: fill the view `get_buffer()` returns, then report
    the byte count to `buffer_updated()`.

    A view never reaches past the end of the part being read (header,
    descriptor or payload), so a read never takes bytes of the next frame. Two
    things follow: payload bytes land straight in the frame's own buffer, and
    `limits` may be changed between frames and applies from the next header on
    (a connection relaxes them right after its handshake's last frame).

    After a FrameError the decoder is dead: every later call raises.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        # Holds one header, then that frame's descriptor; allocated once.
        self._scratch = bytearray(max(HEADER_BYTES, MAX_DESCRIPTOR_BYTES))
        self._scratch_view = memoryview(self._scratch)
        self._failure: FrameError | None = None
        self._start_frame()

    @property
    def payload_capacity(self) -> int:
        """Size of the payload buffer being filled (0 if none): never over the limit."""
        return len(self._payload) if self._state is _State.PAYLOAD else 0

    def feed(self, data: bytes) -> list[Frame]:
        """Decode `data`; returns the frames it completes."""
        data = memoryview(data)
        frames = []
        while data:
            buf = self.get_buffer(len(data))
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            data = data[n:]
            frames += self.buffer_updated(n)
        return frames

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable view for the next incoming bytes.

        `sizehint` is accepted for BufferedProtocol's sake and ignored: the view
        is exactly what the current part still needs, at least one byte.
        """
        self._check_alive()
        if self._state is _State.PAYLOAD:
            return memoryview(self._payload)[self._have :]
        return self._scratch_view[self._have : self._need]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Record `nbytes` written into the last view; returns the frame completed, if any."""
        self._check_alive()
        if not 0 <= nbytes <= self._need - self._have:
            raise ValueError(
                f"buffer_updated({nbytes}) but the last buffer had room for "
                f"{self._need - self._have} bytes"
            )
        self._have += nbytes
        try:
            return self._advance()
        except FrameError as e:
            self._failure = e
            raise

    def _check_alive(self):
        if self._failure is not None:
            raise FrameError(
                f"decoder stopped after an earlier error ({self._failure}); drop the connection"
            )

    def _start_frame(self):
        self._state = _State.HEADER
        self._have, self._need = 0, HEADER_BYTES
        self._payload = bytearray()  # let go of the last frame's payload, which may be large

    def _advance(self) -> list[Frame]:
        # Each step consumes a complete part; a part of zero length is complete at once.
        while self._have == self._need:
            if self._state is _State.HEADER:
                self._read_header()
                self._state, self._have, self._need = _State.DESCRIPTOR, 0, self._descriptor_len
            elif self._state is _State.DESCRIPTOR:
                self._descriptor = self._read_descriptor()
                # Allocated once, sized from the header already checked against the limit.
                self._payload = bytearray(self._payload_len)
                self._state, self._have, self._need = _State.PAYLOAD, 0, self._payload_len
            else:
                frame = Frame(
                    type=self._type,
                    request_id=self._request_id,
                    descriptor=self._descriptor,
                    payload=self._payload if self._payload_len else b"",
                    flags=self._flags,
                )
                self._start_frame()
                return [frame]
        return []

    def _read_header(self):
        magic, version, msg_type, flags, request_id, descriptor_len, payload_len = (
            HEADER.unpack_from(self._scratch)
        )
        if magic != MAGIC:
            raise FrameError(
                f"bad magic {magic!r}, expected {MAGIC!r}: the peer is not a ringd "
                "node or the stream lost sync"
            )
        if version != PROTOCOL_VERSION:
            raise FrameError(
                f"protocol version {version} is not supported (this node speaks "
                f"version {PROTOCOL_VERSION}); run the same ringd version on every node"
            )
        try:
            self._type = MsgType(msg_type)
        except ValueError:
            raise FrameError(f"unknown message type {msg_type}") from None
        name = self._type.name
        if flags & ~KNOWN_FLAGS:
            raise FrameError(f"{name} frame has unknown flag bits set: flags=0x{flags:04x}")
        if descriptor_len > self.limits.max_descriptor_bytes:
            raise FrameError(
                f"{name} frame declares a descriptor of {descriptor_len} bytes, over "
                f"the limit of {self.limits.max_descriptor_bytes} bytes"
            )
        if payload_len > self.limits.max_payload_bytes:
            raise FrameError(
                f"{name} frame declares a payload of {payload_len} bytes, over the "
                f"limit of {self.limits.max_payload_bytes} bytes"
            )
        self._flags, self._request_id = flags, request_id
        self._descriptor_len, self._payload_len = descriptor_len, payload_len

    def _read_descriptor(self) -> dict:
        if not self._descriptor_len:
            return {}
        name = self._type.name
        raw = bytes(self._scratch_view[: self._descriptor_len])
        try:
            descriptor = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        # ValueError: bad UTF-8, bad JSON, NaN/Infinity, ints past Python's digit
        # limit; RecursionError: nesting deeper than the parser's stack.
        except (ValueError, RecursionError) as e:
            raise FrameError(f"{name} frame descriptor is not UTF-8 JSON: {e}") from None
        if not isinstance(descriptor, dict):
            raise FrameError(
                f"{name} frame descriptor must be a JSON object, got {type(descriptor).__name__}"
            )
        return descriptor
