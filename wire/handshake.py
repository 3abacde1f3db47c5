"""Cluster-secret challenge/response that opens every ring connection.

Sans-I/O: frames in, frames out, no sockets or clocks (the stream layer bounds
the whole exchange by HANDSHAKE_TIMEOUT_S).

    both sides, at once:   HELLO {"node", "cluster", "version", "nonce", "info"}
    on the peer's HELLO:   PROOF {"mac": HMAC-SHA256(secret, LABEL + role + transcript)}
    on the peer's PROOF:   done, if the mac verifies

The transcript is the initiator's HELLO then the responder's, each as canonical
JSON (JSON objects delimit themselves, so the concatenation is unambiguous).
Fresh nonces on both sides make every transcript new, and the sender's role in
the MAC keeps one side's proof from passing as the other's.

A peer claiming our own node id is refused. Besides catching a node dialing
itself, this closes the one relay left: getting our HELLO from one connection
accepted as the peer's HELLO on another, so that a MAC we made there fits here.

This authenticates peers; it does not encrypt or sign the frames that follow.
Nothing in `info` is secret: the peer sees it before proving anything.
"""

import enum
import hashlib
import hmac
import json
import re
import secrets

from wire.frames import HANDSHAKE_LIMITS, PROTOCOL_VERSION, Frame, FrameError, MsgType

# A LAN round trip takes milliseconds; an honest peer finishes in well under a
# second even when busy. Longer only helps a stranger hold a connection open.
HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32  # 256 bits: never repeats, so no transcript is ever replayed
# Node ids show up in logs, status tables and plans: short and printable.
MAX_NODE_ID_CHARS = 64
_NODE_ID_RULE = f"a printable str of 1 to {MAX_NODE_ID_CHARS} characters"

_LABEL = b"ringd-handshake-v1|"
_HELLO_KEYS = {"node", "cluster", "version", "nonce", "info"}
_NONCE_HEX = re.compile(f"[0-9a-f]{{{2 * NONCE_BYTES}}}")
_MAC_HEX = re.compile(f"[0-9a-f]{{{2 * hashlib.sha256().digest_size}}}")


class HandshakeError(FrameError):
    """The peer failed the handshake. Messages never include the secret."""


class _State(enum.Enum):
    NEW = enum.auto()
    AWAIT_HELLO = enum.auto()
    AWAIT_PROOF = enum.auto()
    DONE = enum.auto()
    FAILED = enum.auto()


def _canonical(obj: dict) -> bytes:
    # ASCII escapes make any str encodable, lone surrogates included.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _valid_node_id(node_id) -> bool:
    return (
        isinstance(node_id, str) and 0 < len(node_id) <= MAX_NODE_ID_CHARS and node_id.isprintable()
    )


class Handshake:
    """One side of one connection's handshake."""

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: str,
        cluster: str,
        initiator: bool,
        info: dict | None = None,
        nonce: bytes | None = None,
    ):
        if not secret:
            raise ValueError(
                "the cluster secret is empty; every node needs the same non-empty secret"
            )
        if not _valid_node_id(node_id):
            raise ValueError(f"node id {node_id!r:.80} must be {_NODE_ID_RULE}")
        self._secret = secret
        self._node_id = node_id
        self._cluster = cluster
        self._initiator = initiator
        self._nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
        if len(self._nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes, got {len(self._nonce)}")
        self._hello = {
            "node": node_id,
            "cluster": cluster,
            "version": PROTOCOL_VERSION,
            "nonce": self._nonce.hex(),
            "info": info or {},
        }
        size = len(_canonical(self._hello))
        if size > HANDSHAKE_LIMITS.max_descriptor_bytes:
            raise ValueError(
                f"HELLO is {size} bytes, over the handshake limit of "
                f"{HANDSHAKE_LIMITS.max_descriptor_bytes} bytes: make `info` smaller"
            )
        self._state = _State.NEW
        self._peer_hello: dict | None = None
        self._transcript = b""

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def peer_id(self) -> str:
        self._require_done()
        return self._peer_hello["node"]

    @property
    def peer_info(self) -> dict:
        self._require_done()
        return self._peer_hello["info"]

    def start(self) -> list[Frame]:
        """The HELLO to send as soon as the connection is up."""
        if self._state is not _State.NEW:
            raise RuntimeError("Handshake.start() called twice")
        self._state = _State.AWAIT_HELLO
        return [Frame(MsgType.HELLO, descriptor=self._hello)]

    def receive(self, frame: Frame) -> list[Frame]:
        """Take the peer's next frame; returns the frames to send in answer."""
        if self._state is _State.NEW:
            raise RuntimeError("Handshake.receive() before start()")
        try:
            if self._state is _State.AWAIT_HELLO:
                return self._on_hello(frame)
            if self._state is _State.AWAIT_PROOF:
                return self._on_proof(frame)
            raise HandshakeError(
                f"{MsgType(frame.type).name} frame after the handshake "
                f"{'completed' if self.done else 'failed'}"
            )
        except HandshakeError:
            if not self.done:  # a stray frame after success does not undo it
                self._state = _State.FAILED
            raise

    def _require_done(self):
        if not self.done:
            raise RuntimeError("the peer is not authenticated until the handshake is done")

    def _expect(self, frame: Frame, expected: MsgType, keys: set[str]) -> dict:
        if frame.type != expected:
            raise HandshakeError(f"expected {expected.name}, got {MsgType(frame.type).name} frame")
        if len(frame.payload):
            raise HandshakeError(
                f"{expected.name} frame carries a payload; handshake frames have none"
            )
        if frame.descriptor.keys() != keys:
            raise HandshakeError(
                f"{expected.name} must have exactly the keys {sorted(keys)}, got "
                f"{sorted(frame.descriptor)!r:.200}"
            )
        return frame.descriptor

    def _on_hello(self, frame: Frame) -> list[Frame]:
        hello = self._expect(frame, MsgType.HELLO, _HELLO_KEYS)
        version = hello["version"]
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"peer speaks protocol version {version!r:.20}, this node speaks "
                f"{PROTOCOL_VERSION}; run the same ringd version on every node"
            )
        if hello["cluster"] != self._cluster:
            raise HandshakeError(
                f"peer is in cluster {hello['cluster']!r:.80}, this node in {self._cluster!r}"
            )
        nonce = hello["nonce"]
        if not (isinstance(nonce, str) and _NONCE_HEX.fullmatch(nonce)):
            raise HandshakeError(f"peer nonce must be {2 * NONCE_BYTES} lowercase hex digits")
        if nonce == self._hello["nonce"]:
            raise HandshakeError("peer echoed our own nonce (a reflected HELLO)")
        if not _valid_node_id(hello["node"]):
            raise HandshakeError(f"peer node id {hello['node']!r:.80} must be {_NODE_ID_RULE}")
        if hello["node"] == self._node_id:
            raise HandshakeError(
                f"peer claims this node's own id {self._node_id!r}: a connection to "
                "ourselves, two nodes sharing one id, or a relayed HELLO"
            )
        if not isinstance(hello["info"], dict):
            raise HandshakeError(
                f"peer info must be a JSON object, got {type(hello['info']).__name__}"
            )

        self._peer_hello = hello
        ours, theirs = _canonical(self._hello), _canonical(hello)
        self._transcript = ours + theirs if self._initiator else theirs + ours
        self._state = _State.AWAIT_PROOF
        return [Frame(MsgType.PROOF, descriptor={"mac": self._mac(self._initiator).hex()})]

    def _on_proof(self, frame: Frame) -> list[Frame]:
        mac = self._expect(frame, MsgType.PROOF, {"mac"})["mac"]
        if not (isinstance(mac, str) and _MAC_HEX.fullmatch(mac)):
            raise HandshakeError("peer PROOF mac must be 64 lowercase hex digits")
        if not hmac.compare_digest(bytes.fromhex(mac), self._mac(not self._initiator)):
            raise HandshakeError(
                "peer's proof does not match: it holds a different cluster secret "
                "(or the HELLOs were tampered with)"
            )
        self._state = _State.DONE
        return []

    def _mac(self, by_initiator: bool) -> bytes:
        role = b"initiator" if by_initiator else b"responder"
        return hmac.new(self._secret, _LABEL + role + self._transcript, hashlib.sha256).digest()
