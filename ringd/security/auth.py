"""Who may call what over HTTP: API keys for /v1, the cluster secret for control routes and forwarding.

Sans-I/O: header values in, a verdict out; clocks are passed in.

API keys (``api_keys_file``): ``Authorization: Bearer KEY`` (the scheme in any
case), compared in constant time against every configured key. The key itself
never reaches a log or an error message.

Control routes (leader pin, drain) change the cluster, so they need proof of
the cluster secret, which only the owners' machines hold. ``ringctl`` signs
each request:

    X-Ringd-Node:       the node the request is for (its name: a signed request
                        replayed to another node is refused there)
    X-Ringd-Timestamp:  unix seconds
    X-Ringd-Nonce:      32 random hex digits
    X-Ringd-Signature:  HMAC-SHA256(control key, "ringd-control-v1" LF method LF
                        path LF node LF timestamp LF nonce LF SHA-256(body) in hex)

A follower forwarding an API call to the leader (``proxy.py``) proves the
secret the same way, under a key and a label of its own, so that a forwarding
proof is never a valid control signature nor the other way round. Only a
proven forward may carry a stream over (``ringd_resume``), so a client that
sends the header itself is refused:

    X-Ringd-Forwarded-By:       the follower's name
    X-Ringd-Forwarded-To:       the leader it meant (refused by any other node)
    X-Ringd-Forward-Timestamp:  unix seconds
    X-Ringd-Forward-Nonce:      32 random hex digits
    X-Ringd-Forward-Signature:  HMAC-SHA256(forwarding key, "ringd-forward-v1" LF
                                method LF path LF leader LF follower LF timestamp
                                LF nonce LF SHA-256(body) in hex)

A node fetching its layers from a peer that holds the model (``models/peers/``)
proves the secret the same way, under a key of its own, for every file it asks for
(``files.py``); the holder signs the manifest it answers with, whose chunk hashes
then vouch for every byte of the files:

    X-Ringd-Files-Holder:       the node asked (refused by any other node)
    X-Ringd-Files-Fetcher:      the asking node's name
    X-Ringd-Files-Timestamp, X-Ringd-Files-Nonce, X-Ringd-Files-Signature:
                                as above, label "ringd-files-v1", body none
    X-Ringd-Files-Body-Signature (the answer's):
                                HMAC-SHA256(files key, "ringd-files-body-v1" LF
                                the request's nonce LF SHA-256(body) in hex)

Each key is derived from the secret (HMAC-SHA256(secret, a label)) so that no
signature made here is ever valid in the ring handshake, which uses the
secret itself. A request is refused unless its timestamp is within
REPLAY_WINDOW_S of the node's clock, behind or ahead, and its nonce is new: a
nonce is remembered until its own timestamp has left the window, so a request
signed ahead of time cannot be sent once now and again later.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import re
import secrets
from dataclasses import dataclass

from wire import labels

# Clocks of a LAN's Macs agree within seconds (NTP); a signed request whose
# timestamp is further than this from the node's clock, behind or ahead, is
# refused.
REPLAY_WINDOW_S = 60.0
# Nonces remembered at most (each until its timestamp leaves the window, so for
# up to twice the window): ringctl sends a handful a minute, followers one a
# forwarded API call. Past this the ones due to be forgotten first go early,
# which only the secret's holders could make happen.
MAX_REMEMBERED_NONCES = 10_000

NODE_HEADER = "X-Ringd-Node"
TIMESTAMP_HEADER = "X-Ringd-Timestamp"
NONCE_HEADER = "X-Ringd-Nonce"
SIGNATURE_HEADER = "X-Ringd-Signature"

FORWARDED_BY_HEADER = "X-Ringd-Forwarded-By"
FORWARDED_TO_HEADER = "X-Ringd-Forwarded-To"
FORWARD_TIMESTAMP_HEADER = "X-Ringd-Forward-Timestamp"
FORWARD_NONCE_HEADER = "X-Ringd-Forward-Nonce"
FORWARD_SIGNATURE_HEADER = "X-Ringd-Forward-Signature"

FILES_HOLDER_HEADER = "X-Ringd-Files-Holder"
FILES_FETCHER_HEADER = "X-Ringd-Files-Fetcher"
FILES_TIMESTAMP_HEADER = "X-Ringd-Files-Timestamp"
FILES_NONCE_HEADER = "X-Ringd-Files-Nonce"
FILES_SIGNATURE_HEADER = "X-Ringd-Files-Signature"
FILES_BODY_SIGNATURE_HEADER = "X-Ringd-Files-Body-Signature"

_NONCE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True)
class _Scheme:
    """One use of the secret over HTTP, with its own key, label and headers."""

    label: bytes  # the signed message's first line
    key_label: bytes  # derives the scheme's key from the secret
    node: str  # header: the node the request is for
    timestamp: str
    nonce: str
    signature: str
    by: str | None  # header: who signed it, when that is a node (the forwarding follower)
    what: str  # how errors name the proof
    missing: str  # what to tell a sender without one
    elsewhere: str  # what to tell a sender whose proof is for another node


_CONTROL = _Scheme(
    labels.CONTROL_SIGNED, labels.CONTROL_KEY, NODE_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER, None,
    "the request's signature",
    "this route changes the cluster and needs a request signed with the cluster secret (missing {}); "
    "use `ringctl --secret-file FILE ...`",
    "the request was signed for node {!r:.80}, not for {}",
)  # fmt: skip
_FORWARD = _Scheme(
    labels.FORWARD_SIGNED, labels.FORWARD_KEY, FORWARDED_TO_HEADER, FORWARD_TIMESTAMP_HEADER, FORWARD_NONCE_HEADER,
    FORWARD_SIGNATURE_HEADER, FORWARDED_BY_HEADER,
    "the forwarding proof",
    f"{FORWARDED_BY_HEADER} is for ringd followers forwarding to their leader, which prove the cluster secret "
    f"(missing {{}}); a client must not send it",
    "the request was forwarded to node {!r:.80}, but this is {}; the follower retries with the leader it sees now",
)  # fmt: skip


_FILES = _Scheme(
    labels.FILES_SIGNED, labels.FILES_KEY, FILES_HOLDER_HEADER, FILES_TIMESTAMP_HEADER, FILES_NONCE_HEADER,
    FILES_SIGNATURE_HEADER, FILES_FETCHER_HEADER,
    "the request's proof of the cluster secret",
    "a model's files are served to members of the cluster only, which prove its secret (missing {})",
    "the request was signed for node {!r:.80}, but this is {}",
)  # fmt: skip


class AuthError(Exception):
    """Refused; ``status`` is 401 (no or stale credentials) or 403 (wrong ones)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _key(scheme: _Scheme, secret: bytes) -> bytes:
    return hmac.new(secret, scheme.key_label, hashlib.sha256).digest()


def control_key(secret: bytes) -> bytes:
    return _key(_CONTROL, secret)


def body_sha256(body: bytes) -> str:
    """What a signature covers of the body (hashlib lets go of the GIL: callers may run it off the loop)."""
    return hashlib.sha256(body).hexdigest()


def _signature(scheme: _Scheme, key: bytes, method: str, path: str, names: list[str], timestamp: str, nonce: str, digest: str) -> str:
    fields = [scheme.label, method.upper().encode(), path.encode(), *(n.encode() for n in names), timestamp.encode(), nonce.encode(), digest.encode()]
    return hmac.new(key, b"\n".join(fields), hashlib.sha256).hexdigest()


def _sign(scheme: _Scheme, secret: bytes, method: str, path: str, node: str, by: str | None, digest: str, now: float) -> dict[str, str]:
    timestamp, nonce = str(int(now)), secrets.token_hex(16)
    names = [node] if by is None else [node, by]
    headers = {scheme.node: node, scheme.timestamp: timestamp, scheme.nonce: nonce}
    if by is not None:
        headers[scheme.by] = by
    headers[scheme.signature] = _signature(scheme, _key(scheme, secret), method, path, names, timestamp, nonce, digest)
    return headers


def sign(secret: bytes, method: str, path: str, node: str, body: bytes, now: float) -> dict[str, str]:
    """The headers that prove the cluster secret for one control request to ``node``."""
    return _sign(_CONTROL, secret, method, path, node, None, body_sha256(body), now)


def sign_forward(secret: bytes, method: str, path: str, follower: str, leader: str, digest: str, now: float) -> dict[str, str]:
    """The headers with which ``follower`` forwards one API call to ``leader``; ``digest`` is body_sha256(body)."""
    return _sign(_FORWARD, secret, method, path, leader, follower, digest, now)


def sign_files(secret: bytes, method: str, path: str, fetcher: str, holder: str, now: float) -> dict[str, str]:
    """The headers with which ``fetcher`` asks ``holder`` for a file of its model (no body)."""
    return _sign(_FILES, secret, method, path, holder, fetcher, body_sha256(b""), now)


def files_body_signature(secret: bytes, request_nonce: str, digest: str) -> str:
    """What a holder signs its answer with (``digest``: body_sha256 of it), bound to the request."""
    return hmac.new(_key(_FILES, secret), b"\n".join([labels.FILES_BODY_SIGNED, request_nonce.encode(), digest.encode()]), hashlib.sha256).hexdigest()


def check_files_body(secret: bytes, request_nonce: str, body: bytes, signature: str | None) -> None:
    """Raise AuthError unless ``signature`` is the holder's over ``body``, answering our request."""
    expected = files_body_signature(secret, request_nonce, body_sha256(body))
    if signature is None or not hmac.compare_digest(expected, signature):
        raise AuthError(403, "the holder's answer is not signed with this cluster's secret (or was altered on the way)")


def is_signed(headers) -> bool:
    return SIGNATURE_HEADER in headers


class _Verifier:
    """Checks requests signed under one scheme for one node; remembers nonces to refuse replays."""

    scheme: _Scheme

    def __init__(self, secret: bytes, node: str, max_nonces: int = MAX_REMEMBERED_NONCES):
        self.node = node
        self.max_nonces = max_nonces
        self._key = _key(self.scheme, secret)
        self._seen: dict[str, float] = {}  # nonce -> until when it is remembered (its timestamp + the window)
        self._expiry: list[tuple[float, str]] = []  # the same, as a heap: the first to forget on top

    def verify(self, method: str, path: str, headers, body: bytes, now: float) -> str | None:
        """Raise AuthError unless the request is signed with the secret, for this node, fresh and new;
        the signing node's name when the scheme names one."""
        return self.verify_digest(method, path, headers, body_sha256(body), now)

    def verify_digest(self, method: str, path: str, headers, digest: str, now: float) -> str | None:
        """``verify`` with the body's SHA-256 in hex, for a caller that hashed a large body off the loop."""
        s = self.scheme
        names = (s.node, s.timestamp, s.nonce, s.signature) + ((s.by,) if s.by else ())
        values = {h: headers.get(h) for h in names}
        missing = [h for h, v in values.items() if v is None]
        if missing:
            raise AuthError(401, s.missing.format(", ".join(missing)))
        node, timestamp, nonce, signature = (values[h] for h in names[:4])
        by = values.get(s.by) if s.by else None
        if not (_TIMESTAMP.fullmatch(timestamp) and _NONCE.fullmatch(nonce) and _SIGNATURE.fullmatch(signature)):
            raise AuthError(401, f"{s.what} is malformed (headers {', '.join(names)})")
        signed = [node] if by is None else [node, by]
        expected = _signature(s, self._key, method, path, signed, timestamp, nonce, digest)
        if not hmac.compare_digest(expected, signature):
            raise AuthError(403, f"{s.what} does not match: it was not made with this cluster's secret for this request")
        if node != self.node:
            raise AuthError(403, s.elsewhere.format(node, self.node))
        offset = int(timestamp) - now
        if abs(offset) > REPLAY_WINDOW_S:
            where = "ahead of" if offset > 0 else "behind"
            raise AuthError(
                401,
                f"the request's timestamp is {math.ceil(abs(offset))} s {where} this node's clock; "
                f"the window is {REPLAY_WINDOW_S:.0f} s: check the clocks (NTP)",
            )
        self._forget(now)
        if nonce in self._seen:
            raise AuthError(401, "this signed request was already used (a replay); sign a new one")
        # Until the timestamp leaves the window: by then the request is refused as stale anyway.
        until = int(timestamp) + REPLAY_WINDOW_S
        self._seen[nonce] = until
        heapq.heappush(self._expiry, (until, nonce))
        while len(self._seen) > self.max_nonces:
            del self._seen[heapq.heappop(self._expiry)[1]]
        return by

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            del self._seen[heapq.heappop(self._expiry)[1]]


class ControlAuth(_Verifier):
    """Signed control requests (leader pin, drain, status with the secret) for one node."""

    scheme = _CONTROL


class FilesAuth(_Verifier):
    """Requests for this node's model files; ``verify`` returns the fetching node's name."""

    scheme = _FILES


class ForwardAuth(_Verifier):
    """API calls a follower forwards to this node; ``verify`` returns the follower's name."""

    scheme = _FORWARD


def check_api_key(header: str | None, keys: frozenset[str]) -> None:
    """Raise AuthError unless ``header`` is ``Bearer KEY`` for one of ``keys`` (no keys: all may pass).

    The scheme is case-insensitive (RFC 7235 section 2.1: ``bearer KEY`` is the same).
    Any string is refused or accepted, never raised on: a byte aiohttp could not
    decode arrives as a lone surrogate, and is compared as the byte it was.
    """
    if not keys:
        return
    scheme, _, given = (header or "").strip().partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise AuthError(401, "this node needs an API key: send Authorization: Bearer KEY")
    given = given.encode("utf-8", "surrogateescape")
    # Compare with every key, so the time taken does not tell which one is close.
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    if not found:
        raise AuthError(401, "the API key is not valid for this node")
