"""Per-frame authentication (and optional encryption) after the handshake.

Sans-I/O: keys in, buffers out; no sockets, clocks or asyncio. The handshake
derives a Session once both proofs are in; from then on every frame in each
direction is sealed by that direction's Sealer and checked by the other side's
Opener. FrameDecoder and encode_frame (wire.frames) call these; nothing else
needs to.

Keys come from HKDF-SHA256 over the cluster secret, salted with the SHA-256 of
the handshake transcript (both nonces, so every connection has its own keys),
one key per direction so a frame can never be reflected back to its sender.
Each frame has an implicit sequence number per direction, counted from 0 and
never sent: a frame replayed, reordered, dropped or injected is checked under
the wrong number and fails.

Two modes, chosen in the handshake:

    integrity (default)  header | descriptor | payload | keyed BLAKE3(key,
                         seq || header || descriptor || payload), 32 bytes.
                         Nothing is copied: the MAC is fed the caller's buffers.
    encryption           header | AES-256-GCM(descriptor || payload) | tag,
                         16 bytes; nonce = seq, header as associated data.
                         Costs one copy each way: the descriptor and payload are
                         joined before encryption, and the receiver decrypts
                         into a new buffer.

The MAC is keyed BLAKE3 (a MAC by design, as HMAC-SHA256 is; protocol 4 used
HMAC-SHA256): several times faster per byte on the same core (SIMD across its
chunks; SHA-256 is one serial chain even with SHA-NI), which a prefill chunk of
megabytes pays on both ends of every hop, and cheaper to start per frame (no
HMAC pads to copy). The key is 32 bytes from the same HKDF as before.

In both modes the header travels in the clear, because the receiver needs its
lengths to find the frame's end; it is covered by the MAC or the tag, so a
changed header fails the frame like any other changed byte.
"""

import hashlib
import hmac
import struct
from dataclasses import dataclass

from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from wire import labels
from wire.frames import FrameError, IntegrityError

KEY_BYTES = 32  # BLAKE3's key size (keyed mode takes exactly 32 bytes), or AES-256 key
MAC_BYTES = 32  # BLAKE3's default output; truncating buys nothing at these frame sizes
TAG_BYTES = 16  # AES-GCM's full tag
NONCE_BYTES = 12  # AES-GCM's native nonce size: no extra hashing of the nonce
# Sequence numbers are u64. At a million frames a second that is 584,000
# years: a link never runs out, but one that did must not wrap onto old nonces.
MAX_SEQ = 2**64 - 1

_SEQ = struct.Struct("<Q")


class _Sequence:
    """One direction's next sequence number."""

    def __init__(self):
        self.seq = 0

    def current(self) -> int:
        if self.seq > MAX_SEQ:
            raise FrameError(
                "this link has used all 2**64 sequence numbers; reconnect to get new keys"
            )
        return self.seq

    def take(self) -> int:
        seq = self.current()
        self.seq = seq + 1
        return seq


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(NONCE_BYTES, "little")


class MacSealer(_Sequence):
    encrypted = False
    trailer_bytes = MAC_BYTES

    def __init__(self, key: bytes):
        super().__init__()
        self._key = key

    def seal(self, header: bytes, descriptor: bytes, payload: memoryview) -> list:
        """The buffers to write: header+descriptor, the payload as given, the MAC."""
        head = header + descriptor
        mac = blake3(_SEQ.pack(self.take()) + head, key=self._key)
        if not payload.nbytes:
            return [head + mac.digest()]
        mac.update(payload)  # a memoryview: hashed where it lies, not copied
        return [head, payload, mac.digest()]


class AeadSealer(_Sequence):
    encrypted = True
    trailer_bytes = TAG_BYTES

    def __init__(self, key: bytes):
        super().__init__()
        self._aead = AESGCM(key)

    def seal(self, header: bytes, descriptor: bytes, payload: memoryview) -> list:
        """The buffers to write: the header, then the ciphertext with its tag."""
        # AESGCM takes one plaintext buffer: joining is this mode's one copy.
        plaintext = descriptor + payload if payload.nbytes else descriptor
        sealed = self._aead.encrypt(_nonce(self.take()), plaintext, header)
        return [header + sealed] if not payload.nbytes else [header, sealed]


class MacOpener(_Sequence):
    """Checks one direction's MACs; the payload is hashed as it arrives."""

    encrypted = False
    trailer_bytes = MAC_BYTES

    def __init__(self, key: bytes):
        super().__init__()
        self._key = key
        self._mac = None

    def begin(self, head: memoryview):
        """Start a frame: `head` is its header (its descriptor and payload come to `update`)."""
        self._mac = blake3(_SEQ.pack(self.current()), key=self._key)
        self._mac.update(head)

    def update(self, chunk: memoryview):
        self._mac.update(chunk)

    def finish(self, trailer: memoryview, name: str) -> int:
        """Check the frame's MAC; returns its sequence number or raises IntegrityError."""
        expected, self._mac = self._mac.digest(), None
        if not hmac.compare_digest(expected, trailer):
            raise IntegrityError(
                f"{name} frame failed its MAC check as frame {self.seq} of this link: its "
                "bytes were altered, injected, replayed, reordered or dropped on the way"
            )
        return self.take()


class AeadOpener(_Sequence):
    encrypted = True
    trailer_bytes = TAG_BYTES

    def __init__(self, key: bytes):
        super().__init__()
        self._aead = AESGCM(key)

    def open(self, header: memoryview, body: bytearray, name: str) -> tuple[bytearray, int]:
        """Decrypt descriptor+payload+tag into a new buffer; returns it and the frame's seq."""
        plaintext = bytearray(len(body) - TAG_BYTES)
        try:
            self._aead.decrypt_into(_nonce(self.current()), body, header, plaintext)
        except InvalidTag:
            raise IntegrityError(
                f"{name} frame failed its AES-GCM tag check as frame {self.seq} of this "
                "link: its bytes were altered, injected, replayed, reordered or dropped on "
                "the way"
            ) from None
        return plaintext, self.take()


@dataclass(frozen=True)
class Session:
    """Both directions of one authenticated connection."""

    sealer: MacSealer | AeadSealer  # frames we send
    opener: MacOpener | AeadOpener  # frames we receive
    encrypted: bool


def derive_session(secret: bytes, transcript: bytes, *, initiator: bool, encrypt: bool) -> Session:
    """The session keys of one connection, from the secret and its handshake transcript."""
    salt = hashlib.sha256(transcript).digest()
    mode = b"aes-256-gcm|" if encrypt else b"blake3-keyed|"

    def key(direction: bytes) -> bytes:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt,
                    info=labels.SESSION_KEYS + mode + direction)  # fmt: skip
        return hkdf.derive(secret)

    to_responder, to_initiator = key(b"initiator->responder"), key(b"responder->initiator")
    send, receive = (to_responder, to_initiator) if initiator else (to_initiator, to_responder)
    if encrypt:
        return Session(AeadSealer(send), AeadOpener(receive), encrypted=True)
    return Session(MacSealer(send), MacOpener(receive), encrypted=False)
