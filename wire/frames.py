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
    descriptor  UTF-8 JSON object, compact; zero bytes stand for {}; for the
                ring's per-step frames (RAW_TYPES), bytes in a fixed binary
                layout the layer above parses: no JSON per step
    payload     raw bytes
    trailer     sealed frames only (every frame after the handshake's PROOFs):
                a MAC over all of the above, or with encryption the AEAD tag,
                descriptor and payload then being ciphertext; see wire.seal

The header never says whether a frame is sealed or how: both sides know it
from the handshake, so a relay cannot strip a seal by rewriting a flag.
"""

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Protocol

MAGIC = b"RNGD"
# 2: HELLO without node info, INFO after the proofs, every later frame sealed.
# 3: FORWARD and TOKEN descriptors in a fixed binary layout (RAW_TYPES).
# 4: TOKEN carries pooled hidden states (embeddings) beside sampled tokens.
# 5: the integrity MAC is keyed BLAKE3, not HMAC-SHA256 (wire.seal).
# 6: a sampled proposal's draft distribution travels as its most likely tokens' ids and
#    probabilities, not a whole vocabulary of them (FORWARD's payload).
# 7: REDUCE, a tensor-parallel group member's partial sum (binary descriptor).
# 8: a leader's heartbeat names the models it keeps loaded (its "pool"), which a node of 7
#    refuses as a malformed heartbeat: the versions must not meet.
PROTOCOL_VERSION = 8

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
    INFO = 14  # handshake, first sealed frame: the node's info, once the peer proved the secret
    LEAVE = 15  # a node is stopping: take it out of the ring now, do not wait for its heartbeats to stop
    UNLOAD = 16  # leader -> node: drop the layers of one of the leader's instances
    REDUCE = 17  # tensor-parallel group member -> the others: its partial sum of one all-reduce
    MEDIA = 18  # leader -> the ring's first stage: a request's images, before its first FORWARD


# Types whose descriptor is bytes in a fixed binary layout of the layer above's
# (ringd.steps), not JSON: a frame of these goes every step of every request,
# and encoding and parsing JSON was a good part of a hop. The type decides, not
# a flag, so a descriptor is never read in the wrong layout.
RAW_TYPES = frozenset({MsgType.FORWARD, MsgType.TOKEN, MsgType.REDUCE})


class FrameError(Exception):
    """Malformed frame. The stream it came from is out of sync: drop the connection."""


class IntegrityError(FrameError):
    """A sealed stream was tampered with: a frame failed its MAC or tag, or its header
    was one no honest sender writes. Altered, injected, replayed, reordered or
    dropped bytes all end here."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one frame's declared lengths, checked before allocating."""

    max_descriptor_bytes: int = MAX_DESCRIPTOR_BYTES
    max_payload_bytes: int = MAX_PAYLOAD_BYTES

    def __post_init__(self):
        # Limits may tighten the protocol's maxima, never loosen them: the
        # maxima bound what any peer can make this node allocate for one frame.
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
# Before a peer has proved the secret it may only send HELLO and PROOF, never a
# payload. A PROOF is 76 bytes; a HELLO about 150 with ASCII names, and at most
# some 900 with a 64-character node id of characters JSON escapes to 12 bytes.
HANDSHAKE_LIMITS = Limits(max_descriptor_bytes=1024, max_payload_bytes=0)
# INFO, the handshake's last frame, comes once the peer has proved the secret,
# sealed. It carries the node's self-description (model fingerprint, memory
# budget, device profile, addresses): a few hundred bytes today, so 4 KiB leaves
# room to grow while the handshake stays small.
INFO_LIMITS = Limits(max_descriptor_bytes=4 * 1024, max_payload_bytes=0)


@dataclass(frozen=True)
class Frame:
    type: MsgType
    request_id: int = 0
    # A JSON object; for RAW_TYPES, bytes (unparsed here).
    descriptor: dict | bytes = field(default_factory=dict)
    # Decoded frames hold a bytearray, or with encryption a memoryview of the
    # decrypted buffer: rely on the buffer protocol, not on the type.
    payload: bytes | bytearray | memoryview = b""
    flags: int = 0
    # Set by the decoder: the sequence number a sealed frame was verified under
    # (None: it came unsealed). Never sent; encode_frame ignores it.
    seq: int | None = field(default=None, compare=False)


class Sealer(Protocol):
    """What encode_frame needs of a wire.seal sealer."""

    def seal(self, header: bytes, descriptor: bytes, payload: memoryview) -> list: ...


class Opener(Protocol):
    """What FrameDecoder needs of a wire.seal opener.

    With a MAC (`encrypted` false) the decoder calls begin(header), update(chunk)
    as descriptor and payload bytes land, finish(trailer, name) -> seq; with
    encryption, open(header, ciphertext+tag, name) -> (plaintext, seq). Every
    one of them raises IntegrityError, never anything else, on a bad frame.
    """

    encrypted: bool
    trailer_bytes: int


def encode_frame(
    frame: Frame, limits: Limits = DEFAULT_LIMITS, sealer: Sealer | None = None
) -> list:
    """The buffers to write, in order.

    Unsealed: header+descriptor, then the payload if any. With a `sealer` (every
    frame after the handshake's PROOFs), whatever it makes of them: with a MAC,
    header+descriptor, payload, MAC; encrypted, header and ciphertext. The
    sealer takes the frame's sequence number, so encode each frame once, in the
    order it is written.

    Unless encrypted, the payload is passed on as a memoryview of the caller's
    own buffer, never copied, so the caller must not modify it until the
    transport has sent it.
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
    if msg_type in RAW_TYPES:
        if not isinstance(frame.descriptor, (bytes, bytearray)):
            raise FrameError(
                f"{name} frame needs a bytes descriptor, got "
                f"{type(frame.descriptor).__name__}"
            )
        descriptor = frame.descriptor
    elif not isinstance(frame.descriptor, dict):
        raise FrameError(
            f"{name} frame descriptor must be a dict, got {type(frame.descriptor).__name__}"
        )
    else:
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
    if payload.nbytes and (payload.format != "B" or payload.ndim != 1):
        payload = payload.cast("B")
    if sealer is not None:
        return sealer.seal(header, descriptor, payload)
    if payload.nbytes == 0:
        return [header + descriptor]
    return [header + descriptor, payload]


class _State(enum.Enum):
    HEADER = enum.auto()
    DESCRIPTOR = enum.auto()
    PAYLOAD = enum.auto()
    # Sealed: descriptor, payload and MAC (or ciphertext and tag) in one buffer, read as one part:
    # a frame of the ring's hot path is two reads (its header, then the rest), not four.
    BODY = enum.auto()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class FrameDecoder:
    """Incremental decoder: bytes in, complete Frames out.

    Feed it with `feed(data)`, or zero-copy in the style of
    asyncio.BufferedProtocol: fill the view `get_buffer()` returns, then report
    the byte count to `buffer_updated()`.

    A view never reaches past the end of the part being read (header, then
    descriptor and payload, or on a sealed link everything after the header),
    so a read never takes bytes of the next frame. Two things follow: payload
    bytes land straight in the frame's own buffer, and `limits` and `opener` may
    be changed between frames and apply from the next header on (a connection
    starts sealing after its handshake's PROOF and relaxes the limits after its
    INFO).

    With an `opener` (wire.seal), every frame must be sealed: its MAC or tag is
    checked before the descriptor is parsed or the frame handed on, and the
    frame comes out with the sequence number it was checked under.

    Memory: a scratch buffer holds a header and, unsealed, a descriptor, sized
    for the current limits (about 1 KiB under HANDSHAKE_LIMITS) and grown when
    they are relaxed; a sealed frame's descriptor, payload and MAC or tag get
    one buffer of their declared size, as an unsealed frame's payload does.

    After a FrameError the decoder is dead: every later call raises.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, opener: Opener | None = None):
        self._limits = limits
        self._opener = opener
        self._scratch = bytearray()
        self._scratch_view = memoryview(self._scratch)
        self._fit_scratch()
        self._failure: FrameError | None = None
        self._start_frame()

    @property
    def limits(self) -> Limits:
        return self._limits

    @limits.setter
    def limits(self, limits: Limits):
        """Applies from the next header on."""
        self._limits = limits
        self._fit_scratch()

    @property
    def opener(self) -> Opener | None:
        return self._opener

    @opener.setter
    def opener(self, opener: Opener | None):
        if self._state is not _State.HEADER or self._have:
            raise RuntimeError("a decoder's opener can only change between frames")
        self._opener = opener
        self._fit_scratch()

    @property
    def scratch_bytes(self) -> int:
        """Bytes the decoder holds between frames: sized for the limits in force."""
        return len(self._scratch)

    @property
    def payload_capacity(self) -> int:
        """Size of the payload being filled (0 if none): never over the limit."""
        return self._payload_len if self._state in (_State.PAYLOAD, _State.BODY) else 0

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
        if self._own is not None:
            return memoryview(self._own)[self._have :]
        return self._scratch_view[self._start + self._have : self._start + self._need]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Record `nbytes` written into the last view; returns the frame completed, if any."""
        self._check_alive()
        if not 0 <= nbytes <= self._need - self._have:
            raise ValueError(
                f"buffer_updated({nbytes}) but the last buffer had room for "
                f"{self._need - self._have} bytes"
            )
        try:
            opener = self._opener
            if nbytes and self._state is _State.BODY and not opener.encrypted:
                # Hash descriptor and payload as they land, so the MAC is ready when its own
                # bytes (the body's last) are.
                end = min(self._have + nbytes, self._need - opener.trailer_bytes)
                if end > self._have:
                    opener.update(memoryview(self._own)[self._have : end])
            self._have += nbytes
            return self._advance()
        except FrameError as e:
            self._failure = e
            raise

    def _check_alive(self):
        if self._failure is not None:
            raise FrameError(
                f"decoder stopped after an earlier error ({self._failure}); drop the connection"
            )

    def _fit_scratch(self):
        # A sealed frame's descriptor is read into its body, not here.
        size = HEADER_BYTES + (self._limits.max_descriptor_bytes if self._opener is None else 0)
        if size > len(self._scratch):
            # Grown between frames, or mid-header at worst: keep what has arrived.
            grown = bytearray(size)
            grown[: len(self._scratch)] = self._scratch
            self._scratch, self._scratch_view = grown, memoryview(grown)

    def _start_frame(self):
        self._enter(_State.HEADER, HEADER_BYTES)
        self._own = None  # let go of the last frame's payload, which may be large

    def _enter(self, state: _State, need: int, start: int = 0, own: bytearray | None = None):
        """Read the next part: `need` bytes into scratch at `start`, or into `own`."""
        self._state, self._have, self._need, self._start, self._own = state, 0, need, start, own

    def _advance(self) -> list[Frame]:
        # Each step consumes a complete part; a part of zero length is complete at once.
        while self._have == self._need:
            state, opener = self._state, self._opener
            if state is _State.HEADER:
                try:
                    self._read_header()
                except FrameError as e:
                    if opener is None:
                        raise
                    # Every header an honest sender seals passes these checks.
                    raise IntegrityError(
                        f"{e} (on a sealed link: bytes were altered or injected on the way)"
                    ) from None
                d, p = self._descriptor_len, self._payload_len
                if opener is not None:
                    if not opener.encrypted:
                        opener.begin(self._scratch_view[:HEADER_BYTES])
                    # Sized from the header already checked against the limits.
                    body = bytearray(d + p + opener.trailer_bytes)
                    self._enter(_State.BODY, len(body), own=body)
                else:
                    self._enter(_State.DESCRIPTOR, d, start=HEADER_BYTES)
            elif state is _State.DESCRIPTOR:  # unsealed: the handshake's HELLO and PROOF
                head_end = HEADER_BYTES + self._descriptor_len
                self._descriptor = self._read_descriptor(self._scratch_view[HEADER_BYTES:head_end])
                # Allocated once, sized from the header already checked against the limit.
                payload = bytearray(self._payload_len)
                self._enter(_State.PAYLOAD, len(payload), own=payload)
            elif state is _State.PAYLOAD:
                self._payload = self._own
                return [self._complete(None)]
            else:
                d, p = self._descriptor_len, self._payload_len
                if opener.encrypted:
                    header = self._scratch_view[:HEADER_BYTES]
                    plaintext, seq = opener.open(header, self._own, self._type.name)
                    plain = memoryview(plaintext)
                else:  # the MAC checks out before the descriptor is parsed
                    plain = memoryview(self._own)
                    seq = opener.finish(plain[d + p :], self._type.name)
                self._descriptor = self._read_descriptor(plain[:d])
                self._payload = plain[d : d + p]
                return [self._complete(seq)]
        return []

    def _complete(self, seq: int | None) -> Frame:
        frame = Frame(
            type=self._type,
            request_id=self._request_id,
            descriptor=self._descriptor,
            payload=self._payload if self._payload_len else b"",
            flags=self._flags,
            seq=seq,
        )
        self._payload = None
        self._start_frame()
        return frame

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
        if descriptor_len > self._limits.max_descriptor_bytes:
            raise FrameError(
                f"{name} frame declares a descriptor of {descriptor_len} bytes, over "
                f"the limit of {self._limits.max_descriptor_bytes} bytes"
            )
        if payload_len > self._limits.max_payload_bytes:
            raise FrameError(
                f"{name} frame declares a payload of {payload_len} bytes, over the "
                f"limit of {self._limits.max_payload_bytes} bytes"
            )
        self._flags, self._request_id = flags, request_id
        self._descriptor_len, self._payload_len = descriptor_len, payload_len

    def _read_descriptor(self, raw: memoryview) -> dict | bytes:
        if self._type in RAW_TYPES:
            return bytes(raw)  # small; the layer above parses it
        if not len(raw):
            return {}
        name = self._type.name
        try:
            descriptor = json.loads(bytes(raw).decode("utf-8"), parse_constant=_reject_constant)
        # ValueError: bad UTF-8, bad JSON, NaN/Infinity, ints past Python's digit
        # limit; RecursionError: nesting deeper than the parser's stack.
        except (ValueError, RecursionError) as e:
            raise FrameError(f"{name} frame descriptor is not UTF-8 JSON: {e}") from None
        if not isinstance(descriptor, dict):
            raise FrameError(
                f"{name} frame descriptor must be a JSON object, got {type(descriptor).__name__}"
            )
        return descriptor
