"""Handshake state machine: honest peers finish, anything else is a HandshakeError."""

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wire.frames import (
    PROTOCOL_VERSION,
    DEFAULT_LIMITS,
    HANDSHAKE_LIMITS,
    INFO_LIMITS,
    Frame,
    FrameDecoder,
    FrameError,
    MsgType,
    encode_frame,
)
from wire.handshake import NONCE_BYTES, Handshake, HandshakeError
from wire.seal import IntegrityError, derive_session

SECRET = b"s3cret-cluster-key"
MARKER = "MARKER-7f3a"  # in every test node's info: must never be seen early


def side(node_id, *, initiator, secret=SECRET, cluster="lab", info=None, encrypt=False, nonce=None):
    return Handshake(
        secret=secret, node_id=node_id, cluster=cluster, initiator=initiator,
        info={"note": MARKER} if info is None else info, encrypt=encrypt, nonce=nonce,
    )  # fmt: skip


class End:
    """One end of a connection run as wire.stream runs it, on bytes.

    Frames go out sealed once the handshake has a session, and the decoder
    takes its limits and opener from the handshake between frames. Records
    every write with whether the peer had proved the secret by then.
    """

    def __init__(self, handshake: Handshake):
        self.hs = handshake
        self.decoder = FrameDecoder(handshake.limits)
        self.sealer = None
        self.sent: list[tuple[bytes, bool]] = []

    def send(self, frames: list[Frame]) -> bytes:
        data = b"".join(
            bytes(b) for f in frames for b in encode_frame(f, DEFAULT_LIMITS, self.sealer)
        )
        if data:
            self.sent.append((data, self.hs.session is not None))
        return data

    def start(self) -> bytes:
        return self.send(self.hs.start())

    def receive(self, data: bytes) -> bytes:
        """Take the peer's bytes; returns ours in answer."""
        out, pos = b"", 0
        while pos < len(data):
            buf = self.decoder.get_buffer()
            n = min(len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            for frame in self.decoder.buffer_updated(n):
                replies = self.hs.receive(frame)
                if self.sealer is None and self.hs.session is not None:
                    self.sealer = self.hs.session.sealer
                    self.decoder.opener = self.hs.session.opener
                self.decoder.limits = self.hs.limits
                out += self.send(replies)
        return out


def run(a: End, b: End):
    """Deliver bytes both ways until neither side has anything to say."""
    to_b, to_a = a.start(), b.start()
    while to_a or to_b:
        to_b, to_a = a.receive(to_a), b.receive(to_b)


node_ids = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "P"]), min_size=1, max_size=64
)
infos = st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=4)


@settings(max_examples=60)
@given(
    node_ids, node_ids, infos, infos, st.binary(min_size=1, max_size=64),
    st.booleans(), st.booleans(),
)  # fmt: skip
def test_honest_sides_complete_with_each_others_ids_and_info(
    id_a, id_b, info_a, info_b, secret, encrypt_a, encrypt_b
):
    if id_a == id_b:
        id_b += "-b"
    a = End(side(id_a, initiator=True, secret=secret, info=info_a, encrypt=encrypt_a))
    b = End(side(id_b, initiator=False, secret=secret, info=info_b, encrypt=encrypt_b))
    run(a, b)
    assert a.hs.done and b.hs.done
    assert (a.hs.peer_id, a.hs.peer_info) == (id_b, info_b)
    assert (b.hs.peer_id, b.hs.peer_info) == (id_a, info_a)
    assert a.hs.encrypted == b.hs.encrypted == (encrypt_a or encrypt_b)
    assert a.hs.limits == b.hs.limits == DEFAULT_LIMITS
    # The link goes on sealed: the next frame each way is number 1.
    [ping] = b.decoder.feed(a.send([Frame(MsgType.PING, 1, {"x": 1}, b"data")]))
    assert (ping, ping.seq) == (Frame(MsgType.PING, 1, {"x": 1}, b"data"), 1)
    [pong] = a.decoder.feed(b.send([Frame(MsgType.PONG, 1)]))
    assert (pong.type, pong.seq) == (MsgType.PONG, 1)


@settings(max_examples=30)
@given(st.binary(min_size=8, max_size=32), st.binary(min_size=8, max_size=32), st.booleans())
def test_wrong_secret_never_completes_and_learns_nothing(secret_a, secret_b, encrypt):
    if secret_a == secret_b:
        secret_b += b"!"
    a = End(side("a", initiator=True, secret=secret_a, encrypt=encrypt))
    b = End(side("b", initiator=False, secret=secret_b))
    hello_a, hello_b = a.start(), b.start()
    proof_a, proof_b = a.receive(hello_b), b.receive(hello_a)
    for me, their_proof in ((a, proof_b), (b, proof_a)):
        with pytest.raises(HandshakeError, match="different cluster secret") as e:
            me.receive(their_proof)
        assert not me.hs.done and me.hs.session is None
        assert secret_a.hex() not in str(e.value) and secret_b.hex() not in str(e.value)
    assert all(MARKER.encode() not in data for data, _ in a.sent + b.sent)


@settings(max_examples=40)
@given(st.booleans(), st.booleans(), infos)
def test_info_never_leaves_before_the_peer_proved_the_secret(encrypt_a, encrypt_b, info):
    info = {**info, "marker": MARKER}
    a = End(side("a", initiator=True, info=info, encrypt=encrypt_a))
    b = End(side("b", initiator=False, info=info, encrypt=encrypt_b))
    run(a, b)
    for data, peer_proved in a.sent + b.sent:
        if not peer_proved or encrypt_a or encrypt_b:
            assert MARKER.encode() not in data
    # Sanity: unencrypted, it does go out (sealed, readable) once the peer has proved.
    if not (encrypt_a or encrypt_b):
        assert any(MARKER.encode() in data for data, proved in a.sent if proved)


@pytest.mark.parametrize(
    "encrypt_a, encrypt_b", [(False, False), (True, False), (False, True), (True, True)]
)
def test_encryption_is_on_if_either_side_asks(encrypt_a, encrypt_b):
    a = End(side("a", initiator=True, encrypt=encrypt_a))
    b = End(side("b", initiator=False, encrypt=encrypt_b))
    run(a, b)
    assert a.hs.encrypted == b.hs.encrypted == (encrypt_a or encrypt_b)
    assert a.hs.session.encrypted == b.hs.session.encrypted == a.hs.encrypted


# -- relays: a stranger without the secret, in the middle of an honest a and b


def hello_bytes(hs_frames: list[Frame], **changes) -> bytes:
    [hello] = hs_frames
    hello = Frame(MsgType.HELLO, descriptor={**hello.descriptor, **changes})
    return b"".join(bytes(b) for b in encode_frame(hello, HANDSHAKE_LIMITS))


def test_relay_cannot_strip_the_encryption_request():
    """The flags are in the transcript: rewriting one makes both proofs fail."""
    a = End(side("a", initiator=True, encrypt=True))
    b = End(side("b", initiator=False))
    stripped = hello_bytes(a.hs.start(), encrypt=False)
    hello_b = b.start()
    proof_a, proof_b = a.receive(hello_b), b.receive(stripped)
    with pytest.raises(HandshakeError, match="different cluster secret .*tampered"):
        b.receive(proof_a)
    with pytest.raises(HandshakeError, match="tampered"):
        a.receive(proof_b)


def relayed_to_info():
    """A relay passed both HELLOs and PROOFs; a (dialer) then went away. Returns b and a's End."""
    a = End(side("a", initiator=True))
    b = End(side("b", initiator=False))
    hello_a, hello_b = a.start(), b.start()
    proof_a, proof_b = a.receive(hello_b), b.receive(hello_a)
    info_a = a.receive(proof_b)  # not passed on: the relay drops a here
    info_b = b.receive(proof_a)
    assert info_a and info_b and not a.hs.done and not b.hs.done
    return a, b, info_a, info_b, hello_a + hello_b


FORGERIES = [
    "unsealed INFO",
    "INFO sealed with a guessed secret",
    "b's own INFO reflected",
    "a's INFO with a byte flipped",
    "a's INFO truncated",
]


def forge(forgery: str, info_a: bytes, info_b: bytes, transcript_guess: bytes) -> bytes:
    plain = Frame(MsgType.INFO, descriptor={"info": {"node": "relay"}})
    guessed = derive_session(b"guess", transcript_guess, initiator=True, encrypt=False)
    return {
        "unsealed INFO": b"".join(bytes(x) for x in encode_frame(plain, INFO_LIMITS)),
        "INFO sealed with a guessed secret": b"".join(
            bytes(x) for x in encode_frame(plain, INFO_LIMITS, guessed.sealer)
        ),
        "b's own INFO reflected": info_b,
        "a's INFO with a byte flipped": info_a[:-1] + bytes([info_a[-1] ^ 1]),
        "a's INFO truncated": info_a[:-5],
    }[forgery]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_relay_cannot_forge_the_info_that_completes_the_handshake(forgery):
    a, b, info_a, info_b, hellos = relayed_to_info()
    # Zeros after it: whatever length the forgery declares, its end arrives.
    forged = forge(forgery, info_a, info_b, hellos) + bytes(64)
    with pytest.raises(IntegrityError, match="INFO frame failed its MAC check as frame 0"):
        b.receive(forged)
    assert not b.hs.done
    # Only a's own INFO, untouched, completes b.
    _, b2, info_a2, _, _ = relayed_to_info()
    b2.receive(info_a2)
    assert b2.hs.done and b2.hs.peer_id == "a"


def test_relayed_hello_cannot_borrow_a_mac_from_another_connection():
    """A stranger in the middle of two connections of ours, both with our secret.

    It dials us (we respond) and gets us to dial it (we initiate), then passes our
    HELLO from one connection off as its own on the other. Were that accepted,
    both connections would share one transcript, hence one proof and one set of
    session keys, and the stranger could pass our own frames back to us.
    """
    outgoing = side("me", initiator=True)
    incoming = side("me", initiator=False)
    [hello_out], [hello_in] = outgoing.start(), incoming.start()
    with pytest.raises(HandshakeError, match="own id 'me'"):
        incoming.receive(hello_out)
    with pytest.raises(HandshakeError, match="own id 'me'"):
        outgoing.receive(hello_in)


# -- the state machine over (state, input) pairs
#
# The side under test is `me`; `peer` is honest. Inputs are the peer's honest
# frames, frames from another session (replays), tampered or reflected ones,
# other message types and random descriptors. Frames here are as the decoder
# hands them on: an INFO that opened under the session's keys carries seq=0
# (that the decoder refuses any other is tested on bytes, above and in
# test_wire_seal). `me` must finish exactly when given the peer's HELLO, the
# peer's PROOF, then a sealed INFO, and nothing else; any other input is a
# HandshakeError, after which it stays failed.


def session(initiator: bool, nonce_seed: int):
    me = side("me", initiator=initiator, nonce=bytes([nonce_seed]) * NONCE_BYTES)
    twin = side("me", initiator=initiator, nonce=bytes([nonce_seed]) * NONCE_BYTES)
    peer = side(
        "peer", initiator=not initiator, nonce=bytes([nonce_seed + 1]) * NONCE_BYTES,
        info={"peer": "info"},
    )  # fmt: skip
    [my_hello], [peer_hello] = me.start(), peer.start()
    twin.start()
    [peer_proof] = peer.receive(my_hello)
    [my_proof] = twin.receive(peer_hello)  # what `me` will send: same nonce, same transcript
    [peer_info] = peer.receive(my_proof)
    return me, my_hello, peer_hello, peer_proof, dataclasses.replace(peer_info, seq=0)


def tampered(frame: Frame, key: str, value) -> Frame:
    return dataclasses.replace(frame, descriptor={**frame.descriptor, key: value})


def candidate_inputs(initiator: bool) -> dict[str, Frame]:
    _, my_hello, peer_hello, peer_proof, peer_info = session(initiator, nonce_seed=1)
    # The same peer in an earlier session, with other nonces: its frames are replays.
    _, _, old_hello, old_proof, _ = session(initiator, nonce_seed=10)
    without_encrypt = {k: v for k, v in peer_hello.descriptor.items() if k != "encrypt"}
    return {
        "hello": peer_hello,
        "proof": peer_proof,
        "info": peer_info,
        "old hello": old_hello,
        "old proof": old_proof,
        "hello, other cluster": tampered(peer_hello, "cluster", "prod"),
        "hello, version 1": tampered(peer_hello, "version", 1),
        "hello, version true": tampered(peer_hello, "version", True),
        "hello, other node": tampered(peer_hello, "node", "mallory"),
        "hello, asks encryption": tampered(peer_hello, "encrypt", True),
        "hello, encrypt not bool": tampered(peer_hello, "encrypt", 1),
        "hello, v1 with info": Frame(MsgType.HELLO, descriptor={**without_encrypt, "info": {}}),
        "hello, my own id": tampered(peer_hello, "node", "me"),
        "hello, bad nonce": tampered(peer_hello, "nonce", "AB" * NONCE_BYTES),
        "hello, short nonce": tampered(peer_hello, "nonce", "ab"),
        "hello, extra key": tampered(peer_hello, "x", 1),
        "hello with payload": dataclasses.replace(peer_hello, payload=b"x"),
        "my hello reflected": my_hello,
        "proof, flipped mac": tampered(peer_proof, "mac", "00" * 32),
        "proof, mac not hex": tampered(peer_proof, "mac", "zz" * 32),
        "proof, mac number": tampered(peer_proof, "mac", 7),
        "info, other content": tampered(peer_info, "info", {"node": "anything"}),
        "info, unsealed": dataclasses.replace(peer_info, seq=None),
        "info, seq 1": dataclasses.replace(peer_info, seq=1),
        "info, not an object": tampered(peer_info, "info", [1, 2]),
        "info, extra key": tampered(peer_info, "x", 1),
        "info with payload": dataclasses.replace(peer_info, payload=b"x"),
        "ping": Frame(MsgType.PING),
        "sealed ping": Frame(MsgType.PING, seq=0),
        "forward": Frame(MsgType.CONTROL, 1, {"tensor": {}}, b"\0" * 8, seq=0),
    }


INPUTS = {initiator: candidate_inputs(initiator) for initiator in (True, False)}
junk_frames = st.builds(
    Frame,
    type=st.sampled_from([MsgType.HELLO, MsgType.PROOF, MsgType.INFO]) | st.integers(0, 255),
    descriptor=st.dictionaries(
        st.sampled_from(["node", "cluster", "version", "nonce", "encrypt", "info", "mac"]),
        st.none()
        | st.booleans()
        | st.integers()
        | st.text(max_size=70)
        | st.dictionaries(st.text(), st.text()),
    ),
    payload=st.sampled_from([b"", b"x"]),
    seq=st.sampled_from([None, 0, 1]),
)


# HELLOs `me` has no grounds to refuse on sight; only the "hello" it really got
# from this peer in this session makes the following "proof" verify.
PLAUSIBLE_HELLOS = {"hello", "old hello", "hello, other node", "hello, asks encryption"}
# INFOs that opened under the session's keys: the handshake can only check their shape.
PLAUSIBLE_INFOS = {"info", "info, other content"}
# What `me` may be sent next, after each number of accepted frames.
LIMITS_AFTER = [HANDSHAKE_LIMITS, HANDSHAKE_LIMITS, INFO_LIMITS, DEFAULT_LIMITS]


def well_formed_info(frame: Frame) -> bool:
    return (
        frame.type == MsgType.INFO
        and frame.seq == 0
        and not frame.payload
        and frame.descriptor.keys() == {"info"}
        and isinstance(frame.descriptor["info"], dict)
    )


@settings(max_examples=500)
@given(
    st.booleans(),
    st.lists(st.sampled_from(sorted(INPUTS[True])) | junk_frames, max_size=5),
)
@example(True, ["hello", "proof", "info", "ping"])
@example(False, ["hello", "proof", "proof"])
@example(False, ["hello", "hello", "proof"])
@example(True, ["old hello", "proof"])
@example(True, ["hello", "old proof", "proof"])
@example(False, ["hello, asks encryption", "proof"])
@example(True, ["proof", "hello"])
@example(True, ["hello", "proof", "info, unsealed", "info"])
@example(False, ["hello", "proof", "info, seq 1"])
@example(False, ["hello", "proof", "sealed ping"])
@example(True, ["hello", "info"])
def test_every_input_in_every_state_advances_or_fails(initiator, script):
    me = session(initiator, nonce_seed=1)[0]
    accepted: list[str] = []
    failed = False
    for item in script:
        named = isinstance(item, str)
        frame = INPUTS[initiator][item] if named else item
        if failed or me.done:
            should_pass = False
        elif not accepted:
            should_pass = named and item in PLAUSIBLE_HELLOS
        elif len(accepted) == 1:
            should_pass = accepted == ["hello"] and item == "proof"
        else:
            should_pass = item in PLAUSIBLE_INFOS if named else well_formed_info(frame)
        try:
            replies = me.receive(frame)
        except HandshakeError as e:
            assert not should_pass, f"{item!r} refused after {accepted}: {e}"
            assert "s3cret" not in str(e)
            failed = True
        else:
            assert should_pass, f"{item!r} accepted after {accepted}"
            accepted.append(item)
            expected = [[MsgType.PROOF], [MsgType.INFO], []][len(accepted) - 1]
            assert [r.type for r in replies] == expected
            # Nothing about this node goes out until the peer's proof has verified.
            if len(accepted) == 1:
                assert MARKER not in repr(replies)
            if len(accepted) == 2:
                assert replies[0].descriptor == {"info": {"note": MARKER}}
        assert me.done == (len(accepted) == 3)
        # A stray frame after success does not undo it; a failure before does.
        keyed = len(accepted) == 3 or (len(accepted) == 2 and not failed)
        assert (me.session is not None) == keyed
        if me.done or not failed:
            assert me.limits == LIMITS_AFTER[len(accepted)]


def test_pairs_of_state_and_input():
    """Spelled out for reading: the honest path, and what each stray input meets."""
    me, *_ = session(True, nonce_seed=1)
    inputs = INPUTS[True]

    def fresh():
        return session(True, 1)[0]

    with pytest.raises(HandshakeError, match="expected HELLO, got PROOF"):
        fresh().receive(inputs["proof"])
    with pytest.raises(HandshakeError, match="cluster 'prod'"):
        fresh().receive(inputs["hello, other cluster"])
    with pytest.raises(HandshakeError, match=f"protocol version 1, this node speaks {PROTOCOL_VERSION}"):
        fresh().receive(inputs["hello, version 1"])
    with pytest.raises(HandshakeError, match=r"exactly the keys .*'encrypt'"):
        fresh().receive(inputs["hello, v1 with info"])
    with pytest.raises(HandshakeError, match="encrypt must be true or false"):
        fresh().receive(inputs["hello, encrypt not bool"])
    with pytest.raises(HandshakeError, match="echoed our own nonce"):
        fresh().receive(inputs["my hello reflected"])
    with pytest.raises(HandshakeError, match="own id 'me'"):
        fresh().receive(inputs["hello, my own id"])
    with pytest.raises(HandshakeError, match="lowercase hex"):
        fresh().receive(inputs["hello, bad nonce"])
    with pytest.raises(HandshakeError, match="expected HELLO, got type 99"):
        fresh().receive(Frame(99))

    assert [f.type for f in me.receive(inputs["hello"])] == [MsgType.PROOF]
    assert me.session is None
    with pytest.raises(HandshakeError, match="expected PROOF, got HELLO"):
        after(["hello"]).receive(inputs["hello"])
    with pytest.raises(HandshakeError, match="different cluster secret"):
        after(["hello"]).receive(inputs["old proof"])

    assert [f.type for f in me.receive(inputs["proof"])] == [MsgType.INFO]
    assert not me.done and me.session is not None
    with pytest.raises(RuntimeError, match="not authenticated"):
        _ = me.peer_id  # proofs alone can be relayed: not yet
    with pytest.raises(HandshakeError, match="INFO must be its first sealed frame .*unsealed"):
        after(["hello", "proof"]).receive(inputs["info, unsealed"])
    with pytest.raises(HandshakeError, match="seq 1"):
        after(["hello", "proof"]).receive(inputs["info, seq 1"])
    with pytest.raises(HandshakeError, match="expected INFO, got PING"):
        after(["hello", "proof"]).receive(inputs["sealed ping"])
    with pytest.raises(HandshakeError, match="must be a JSON object, got list"):
        after(["hello", "proof"]).receive(inputs["info, not an object"])

    assert me.receive(inputs["info"]) == [] and me.done
    assert (me.peer_id, me.peer_info, me.encrypted) == ("peer", {"peer": "info"}, False)
    with pytest.raises(HandshakeError, match="PING frame after the handshake completed"):
        me.receive(inputs["ping"])
    assert me.done  # a stray frame after success does not undo it


def after(items: list[str]) -> Handshake:
    me = session(True, nonce_seed=1)[0]
    for item in items:
        me.receive(INPUTS[True][item])
    return me


def test_info_is_read_when_it_is_sent():
    """The daemon fills in its addresses after making the handshake; the peer sees them."""
    info = {"model": "m"}
    a = End(side("a", initiator=True, info=info))
    b = End(side("b", initiator=False))
    hello_a, hello_b = a.start(), b.start()
    info["addr"] = "10.0.0.1:50051"
    proof_a, proof_b = a.receive(hello_b), b.receive(hello_a)
    b.receive(proof_a + a.receive(proof_b))
    info["addr"] = "changed after sending"
    assert b.hs.done and b.hs.peer_info == {"model": "m", "addr": "10.0.0.1:50051"}


def test_info_grown_past_its_limit_fails_our_side_with_a_reason():
    info = {}
    a = End(side("a", initiator=True, info=info))
    b = End(side("b", initiator=False))
    hello_a, hello_b = a.start(), b.start()
    a.receive(hello_b)
    proof_b = b.receive(hello_a)
    info["blob"] = "x" * 5000
    with pytest.raises(HandshakeError, match="own info cannot be sent.*make `info` smaller"):
        a.receive(proof_b)


def test_construction_errors():
    with pytest.raises(ValueError, match="secret is empty"):
        side("a", initiator=True, secret=b"")
    with pytest.raises(ValueError, match="node id ''"):
        side("", initiator=True)
    with pytest.raises(ValueError, match="node id 'x\\\\n'"):
        side("x\n", initiator=True)
    with pytest.raises(ValueError, match="limit of 4096 bytes: make `info` smaller"):
        side("a", initiator=True, info={"blob": "x" * 5000})
    with pytest.raises(ValueError, match="not JSON-serializable"):
        side("a", initiator=True, info={"x": object()})
    with pytest.raises(ValueError, match="shorten the cluster name"):
        side("a", initiator=True, cluster="c" * 2000)
    with pytest.raises(ValueError, match=f"nonce must be {NONCE_BYTES} bytes"):
        side("a", initiator=True, nonce=b"short")


def test_identity_is_hidden_until_done_and_calls_are_ordered():
    a = side("a", initiator=True)
    for attribute in ("peer_id", "peer_info", "encrypted"):
        with pytest.raises(RuntimeError, match="not authenticated"):
            getattr(a, attribute)
    with pytest.raises(RuntimeError, match="before start"):
        a.receive(Frame(MsgType.HELLO))
    a.start()
    with pytest.raises(RuntimeError, match="twice"):
        a.start()


def test_errors_are_frame_errors():
    """A caller that catches FrameError catches every way a peer can fail."""
    assert issubclass(HandshakeError, FrameError) and issubclass(IntegrityError, FrameError)
