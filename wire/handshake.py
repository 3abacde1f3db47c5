"""Cluster-secret handshake that opens every ring connection and keys its session.

Sans-I/O: frames in, frames out, no sockets or clocks (the stream layer bounds
the whole exchange by HANDSHAKE_TIMEOUT_S).

    both sides, at once:  HELLO {"node", "cluster", "version", "nonce", "encrypt"}
    on the peer's HELLO:  PROOF {"mac": HMAC-SHA256(secret, labels.HANDSHAKE_PROOF + role + transcript)}
    on the peer's PROOF:  derive the session keys (wire.seal), then
                          INFO {"info": {...}}, the first sealed frame
    on the peer's INFO:   done, if it opened as the peer's first sealed frame

The transcript is the initiator's HELLO then the responder's, each as canonical
JSON (JSON objects delimit themselves, so the concatenation is unambiguous).
Fresh nonces on both sides make every transcript new, and the sender's role in
the MAC keeps one side's proof from passing as the other's.

The PROOFs alone can be relayed: a stranger that a node dials can dial another
node itself and pass HELLOs and PROOFs between the two. What it cannot do is
anything after them. Every later frame, INFO first, is sealed with keys derived
from the secret and the transcript, so the stranger can neither complete the
handshake once it drops one side nor inject, replay or alter a frame while it
passes them on. A side trusts the link only when both proofs are in and the
peer's INFO has opened under those keys; `peer_id`, `peer_info` and
`encrypted` are unavailable until then.

Nothing about the node leaves before the peer's proof has verified: a HELLO
says only who is asking (node id, cluster, protocol version) with a nonce and
whether it wants encryption. The link is encrypted if either HELLO asks; both
flags are in the transcript, so a relay that strips one makes the proofs fail.
Without encryption INFO and all later frames are readable on the path, though
not alterable.

A peer claiming our own node id is refused. Besides catching a node dialing
itself, this closes the one relay the transcript leaves: getting our HELLO from
one connection accepted as the peer's HELLO on another, so that both
connections share one transcript, and so our proof and our sealed frames made
for one would fit the other.
"""

import enum
import hashlib
import hmac
import json
import re
import secrets

from wire import labels
from wire.frames import (
    DEFAULT_LIMITS,
    HANDSHAKE_LIMITS,
    INFO_LIMITS,
    PROTOCOL_VERSION,
    Frame,
    FrameError,
    Limits,
    MsgType,
)
from wire.seal import Session, derive_session

# A LAN round trip takes milliseconds; an honest peer finishes its two round
# trips in well under a second even when busy. Longer only helps a stranger hold
# a connection open.
HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32  # 256 bits: never repeats, so no transcript is ever replayed
# Node ids show up in logs, status tables and plans: short and printable.
MAX_NODE_ID_CHARS = 64
_NODE_ID_RULE = f"a printable str of 1 to {MAX_NODE_ID_CHARS} characters"

_HELLO_KEYS = {"node", "cluster", "version", "nonce", "encrypt"}
_NONCE_HEX = re.compile(f"[0-9a-f]{{{2 * NONCE_BYTES}}}")
_MAC_HEX = re.compile(f"[0-9a-f]{{{2 * hashlib.sha256().digest_size}}}")


class HandshakeError(FrameError):
    """The peer failed the handshake. Messages never include the secret."""


class _State(enum.Enum):
    NEW = enum.auto()
    AWAIT_HELLO = enum.auto()
    AWAIT_PROOF = enum.auto()
    AWAIT_INFO = enum.auto()
    DONE = enum.auto()
    FAILED = enum.auto()


# What the peer may send next, by state: the stream applies these to its decoder.
_LIMITS = {
    _State.NEW: HANDSHAKE_LIMITS,
    _State.AWAIT_HELLO: HANDSHAKE_LIMITS,
    _State.AWAIT_PROOF: HANDSHAKE_LIMITS,
    _State.AWAIT_INFO: INFO_LIMITS,
    _State.DONE: DEFAULT_LIMITS,
    _State.FAILED: HANDSHAKE_LIMITS,
}


def _canonical(obj: dict) -> bytes:
    # ASCII escapes make any str encodable, lone surrogates included.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _valid_node_id(node_id) -> bool:
    return (
        isinstance(node_id, str) and 0 < len(node_id) <= MAX_NODE_ID_CHARS and node_id.isprintable()
    )


def _type_name(frame: Frame) -> str:
    try:
        return MsgType(frame.type).name
    except ValueError:
        return f"type {frame.type!r:.20}"


def _encode_info(info: dict) -> bytes:
    """INFO's descriptor as it will be sent; ValueError if it cannot be."""
    if not isinstance(info, dict):
        raise ValueError(f"info must be a dict, got {type(info).__name__}")
    try:
        encoded = json.dumps({"info": info}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"info is not JSON-serializable: {e}") from e
    if len(encoded) > INFO_LIMITS.max_descriptor_bytes:
        raise ValueError(
            f"INFO is {len(encoded)} bytes, over the limit of "
            f"{INFO_LIMITS.max_descriptor_bytes} bytes: make `info` smaller"
        )
    return encoded


class Handshake:
    """One side of one connection's handshake.

    `info` is this node's self-description for the peer. It is read when INFO
    is sent, once the peer has proved the secret, not when the Handshake is
    made: a caller may fill the dict in later (its ports, once bound).
    `encrypt` asks for AES-GCM on the link; either side asking is enough.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: str,
        cluster: str,
        initiator: bool,
        info: dict | None = None,
        encrypt: bool = False,
        nonce: bytes | None = None,
    ):
        if not secret:
            raise ValueError(
                "the cluster secret is empty; every node needs the same non-empty secret"
            )
        if not _valid_node_id(node_id):
            raise ValueError(f"node id {node_id!r:.80} must be {_NODE_ID_RULE}")
        if not isinstance(cluster, str):
            raise ValueError(f"cluster name must be a str, got {type(cluster).__name__}")
        self._info = {} if info is None else info
        _encode_info(self._info)  # fail at construction, not at the first peer
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
            "encrypt": bool(encrypt),
        }
        size = len(_canonical(self._hello))
        if size > HANDSHAKE_LIMITS.max_descriptor_bytes:
            raise ValueError(
                f"HELLO is {size} bytes, over the handshake limit of "
                f"{HANDSHAKE_LIMITS.max_descriptor_bytes} bytes: shorten the cluster name"
            )
        self._state = _State.NEW
        self._peer_hello: dict | None = None
        self._peer_info: dict | None = None
        self._transcript = b""
        self._session: Session | None = None

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
        return self._peer_info

    @property
    def encrypted(self) -> bool:
        """Whether the link's frames are encrypted (else only authenticated)."""
        self._require_done()
        return self._session.encrypted

    @property
    def session(self) -> Session | None:
        """The link's sealer and opener, from the moment the peer's PROOF verified.

        Every frame after that, both ways, is sealed: the INFO that receive()
        returns then, and the peer's INFO. None until then.
        """
        return self._session if self._state in (_State.AWAIT_INFO, _State.DONE) else None

    @property
    def limits(self) -> Limits:
        """Bounds for the peer's next frame: tight until its INFO is in."""
        return _LIMITS[self._state]

    def start(self) -> list[Frame]:
        """The HELLO to send as soon as the connection is up."""
        if self._state is not _State.NEW:
            raise RuntimeError("Handshake.start() called twice")
        self._state = _State.AWAIT_HELLO
        return [Frame(MsgType.HELLO, descriptor=self._hello)]

    def receive(self, frame: Frame) -> list[Frame]:
        """Take the peer's next frame; returns the frames to send in answer.

        Frames returned while `session` is set must go out sealed with it.
        """
        if self._state is _State.NEW:
            raise RuntimeError("Handshake.receive() before start()")
        try:
            if self._state is _State.AWAIT_HELLO:
                return self._on_hello(frame)
            if self._state is _State.AWAIT_PROOF:
                return self._on_proof(frame)
            if self._state is _State.AWAIT_INFO:
                return self._on_info(frame)
            raise HandshakeError(
                f"{_type_name(frame)} frame after the handshake "
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
            raise HandshakeError(f"expected {expected.name}, got {_type_name(frame)} frame")
        if len(frame.payload):
            raise HandshakeError(
                f"{expected.name} frame carries a payload; handshake frames have none"
            )
        if not isinstance(frame.descriptor, dict) or frame.descriptor.keys() != keys:
            raise HandshakeError(
                f"{expected.name} must have exactly the keys {sorted(keys)}, got "
                f"{sorted(map(str, frame.descriptor))!r:.200}"
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
        if type(hello["encrypt"]) is not bool:
            raise HandshakeError(
                f"peer HELLO's encrypt must be true or false, got {hello['encrypt']!r:.20}"
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
        # Only now may anything about this node go out, and only sealed.
        try:
            encoded = _encode_info(self._info)
        except ValueError as e:
            raise HandshakeError(f"this node's own info cannot be sent: {e}") from None
        encrypt = self._hello["encrypt"] or self._peer_hello["encrypt"]
        self._session = derive_session(
            self._secret, self._transcript, initiator=self._initiator, encrypt=encrypt
        )
        self._state = _State.AWAIT_INFO
        # A snapshot: what is sent is what was checked, whatever the caller changes later.
        return [Frame(MsgType.INFO, descriptor=json.loads(encoded))]

    def _on_info(self, frame: Frame) -> list[Frame]:
        info = self._expect(frame, MsgType.INFO, {"info"})["info"]
        # The decoder sets seq only on frames whose MAC or tag verified.
        if frame.seq != 0:
            raise HandshakeError(
                "peer's INFO must be its first sealed frame (seq 0), got "
                f"{'an unsealed frame' if frame.seq is None else f'seq {frame.seq!r:.20}'}"
            )
        if not isinstance(info, dict):
            raise HandshakeError(f"peer info must be a JSON object, got {type(info).__name__}")
        self._peer_info = info
        self._state = _State.DONE
        return []

    def _mac(self, by_initiator: bool) -> bytes:
        role = b"initiator" if by_initiator else b"responder"
        return hmac.new(self._secret, labels.HANDSHAKE_PROOF + role + self._transcript, hashlib.sha256).digest()
