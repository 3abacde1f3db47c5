"""Weights sealed for one fetcher: a Range of a model's file as AEAD chunks, when ring_encryption is on.

A holder whose network ``ring_encryption`` calls untrusted does not send a model's
bytes in the clear (``http/files.py``), and a fetcher with ``ring_encryption``
asks for them sealed (``models/peers/``, header SEALED_HEADER). The bytes of one
answer are cut into chunks of SEAL_CHUNK_BYTES (the last one shorter), each sent
as AES-256-GCM ciphertext and its 16-byte tag:

    key    = HKDF-SHA256(cluster secret, salt = the request's nonce,
                         info = labels.FILES_SEAL_KEY | path | start | count)
    chunk i: nonce = i (12 bytes, little-endian), associated data = i | last?

The request's nonce is fresh and never accepted twice (``auth.FilesAuth``), so
every answer has its own key; the path and the Range are in the key, so an answer
to one request opens under no other. A chunk's index is its nonce and the last
chunk says it is last: chunks reordered, dropped, repeated or cut short fail to
open. What this protects is the bytes' secrecy: their integrity is the manifest's
BLAKE3 as before (a chunk that opens is still checked as a piece). The request header
is not signed, and need not be: a path that strips it gets a 403 from a holder with
ring_encryption, and a fetcher that asked takes no answer that is not sealed, so a path
that strips or adds it gets no byte sent in the clear, only a failed request.

Sans-I/O: keys and buffers in, buffers out. Sealing costs a copy and a pass of
AES-GCM (a GB/s or more a core): callers run it off the event loop.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from wire import labels

# The request header by which a fetcher asks for sealed bytes, and the answer's, which says
# they are: its value names the scheme, so a later one is never opened as this one.
SEALED_HEADER = "X-Ringd-Files-Sealed"
SCHEME = "aes-256-gcm-v1"
# Plaintext bytes a chunk: a thread hop and 16 bytes of tag per MiB, and no more than this
# held per stream beyond the piece buffer.
SEAL_CHUNK_BYTES = 1024 * 1024
TAG_BYTES = 16  # AES-GCM's full tag
NONCE_BYTES = 12


class SealError(Exception):
    """A chunk did not open: not sealed for this request, or changed, reordered or cut."""


def _key(secret: bytes, nonce: str, path: str, start: int, count: int) -> AESGCM:
    info = b"|".join([labels.FILES_SEAL_KEY, path.encode(), str(start).encode(), str(count).encode()])
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=nonce.encode(), info=info).derive(secret)
    return AESGCM(key)


def sealed_length(count: int) -> int:
    """Bytes on the wire for ``count`` bytes of a file: each chunk's tag added."""
    return count + TAG_BYTES * chunks(count)


def chunks(count: int) -> int:
    return max(1, -(-count // SEAL_CHUNK_BYTES))


def _aad(index: int, last: bool) -> bytes:
    return index.to_bytes(8, "little") + (b"\x01" if last else b"\x00")


class Sealer:
    """The holder's side of one answer: chunk i of ``count`` bytes in, its ciphertext and tag out."""

    def __init__(self, secret: bytes, nonce: str, path: str, start: int, count: int):
        self._aead, self.count = _key(secret, nonce, path, start, count), count

    def seal(self, index: int, plain: bytes) -> bytes:
        return self._aead.encrypt(index.to_bytes(NONCE_BYTES, "little"), plain, _aad(index, index == chunks(self.count) - 1))


class Opener:
    """The fetcher's side: chunk i's sealed bytes in, its plaintext out (SealError if it does not open)."""

    def __init__(self, secret: bytes, nonce: str, path: str, start: int, count: int):
        self._aead, self.count = _key(secret, nonce, path, start, count), count

    def chunk_bytes(self, index: int) -> int:
        """Sealed bytes of chunk ``index`` on the wire."""
        return min(SEAL_CHUNK_BYTES, self.count - index * SEAL_CHUNK_BYTES) + TAG_BYTES

    def open(self, index: int, sealed: bytes) -> bytes:
        try:
            return self._aead.decrypt(index.to_bytes(NONCE_BYTES, "little"), sealed, _aad(index, index == chunks(self.count) - 1))
        except InvalidTag:
            raise SealError(f"chunk {index} of a sealed answer does not open: not sealed for this request, or changed on the way") from None
