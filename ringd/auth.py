"""Who may call what over HTTP: API keys for /v1, the cluster secret for control routes.

Sans-I/O: header values in, a verdict out; clocks are passed in.

API keys (``api_keys_file``): ``Authorization: Bearer KEY``, compared in
constant time against every configured key. The key itself never reaches a
log or an error message.

Control routes (leader pin, drain) change the cluster, so they need proof of
the cluster secret, which only the owners' machines hold. ``ringctl`` signs
each request:

    X-Ringd-Node:       the node the request is for (its name: a signed request
                        replayed to another node is refused there)
    X-Ringd-Timestamp:  unix seconds
    X-Ringd-Nonce:      32 random hex digits
    X-Ringd-Signature:  HMAC-SHA256(control key, "ringd-control-v1" LF method LF
                        path LF node LF timestamp LF nonce LF SHA-256(body) in hex)

The control key is derived from the secret (HMAC-SHA256(secret, a label)) so
that no signature made here is ever valid in the ring handshake, which uses
the secret itself. A request is refused unless its timestamp is within
REPLAY_WINDOW_S of the node's clock and its nonce was not seen in that window.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass

# Clocks of a LAN's Macs agree within seconds (NTP); a signed request older than
# this is refused, and nonces are remembered this long to refuse replays.
REPLAY_WINDOW_S = 60.0
# Nonces remembered at most: ringctl sends a handful a minute. Past this the
# oldest are forgotten, which only the secret's holders could make happen.
MAX_REMEMBERED_NONCES = 10_000

NODE_HEADER = "X-Ringd-Node"
TIMESTAMP_HEADER = "X-Ringd-Timestamp"
NONCE_HEADER = "X-Ringd-Nonce"
SIGNATURE_HEADER = "X-Ringd-Signature"

_LABEL = b"ringd-control-v1"
_KEY_LABEL = b"ringd control-route key v1"
_NONCE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class AuthError(Exception):
    """Refused; ``status`` is 401 (no or stale credentials) or 403 (wrong ones)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def control_key(secret: bytes) -> bytes:
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def _signature(key: bytes, method: str, path: str, node: str, timestamp: str, nonce: str, body: bytes) -> str:
    message = b"\n".join(
        [_LABEL, method.upper().encode(), path.encode(), node.encode(), timestamp.encode(), nonce.encode(), hashlib.sha256(body).hexdigest().encode()]
    )
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, node: str, body: bytes, now: float) -> dict[str, str]:
    """The headers that prove the cluster secret for one request to ``node``."""
    timestamp, nonce = str(int(now)), secrets.token_hex(16)
    return {
        NODE_HEADER: node,
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: _signature(control_key(secret), method, path, node, timestamp, nonce, body),
    }


def is_signed(headers) -> bool:
    return SIGNATURE_HEADER in headers


@dataclass
class ControlAuth:
    """Checks signed control requests for one node; remembers nonces to refuse replays."""

    secret: bytes
    node: str

    def __post_init__(self):
        self._key = control_key(self.secret)
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when seen

    def verify(self, method: str, path: str, headers, body: bytes, now: float) -> None:
        """Raise AuthError unless the request is signed with the secret, for this node, fresh and new."""
        values = {h: headers.get(h) for h in (NODE_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)}
        missing = [h for h, v in values.items() if v is None]
        if missing:
            raise AuthError(
                401,
                "this route changes the cluster and needs a request signed with the cluster secret "
                f"(missing {', '.join(missing)}); use `ringctl --secret-file FILE ...`",
            )
        node, timestamp, nonce, signature = values.values()
        if not (_TIMESTAMP.fullmatch(timestamp) and _NONCE.fullmatch(nonce) and _SIGNATURE.fullmatch(signature)):
            raise AuthError(401, "malformed signature headers; use `ringctl --secret-file FILE ...`")
        expected = _signature(self._key, method, path, node, timestamp, nonce, body)
        if not hmac.compare_digest(expected, signature):
            raise AuthError(403, "the request's signature does not match: it was not signed with this cluster's secret")
        if node != self.node:
            raise AuthError(403, f"the request was signed for node {node!r:.80}, not for {self.node}")
        if abs(now - int(timestamp)) > REPLAY_WINDOW_S:
            raise AuthError(401, f"the request's timestamp is more than {REPLAY_WINDOW_S:.0f} s from this node's clock; check both clocks (NTP)")
        self._forget_before(now - REPLAY_WINDOW_S)
        if nonce in self._seen:
            raise AuthError(401, "this signed request was already used (a replay); sign a new one")
        self._seen[nonce] = now
        while len(self._seen) > MAX_REMEMBERED_NONCES:
            self._seen.popitem(last=False)

    def _forget_before(self, cutoff: float) -> None:
        while self._seen:
            nonce, seen = next(iter(self._seen.items()))
            if seen >= cutoff:
                return
            del self._seen[nonce]


def check_api_key(header: str | None, keys: frozenset[str]) -> None:
    """Raise AuthError unless ``header`` is ``Bearer KEY`` for one of ``keys`` (no keys: all may pass)."""
    if not keys:
        return
    if not header or not header.startswith("Bearer "):
        raise AuthError(401, "this node needs an API key: send Authorization: Bearer KEY")
    given = header[len("Bearer ") :].strip().encode()
    # Compare with every key, so the time taken does not tell which one is close.
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    if not found:
        raise AuthError(401, "the API key is not valid for this node")
