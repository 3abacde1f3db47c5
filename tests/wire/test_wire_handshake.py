"""Handshake state machine: honest peers finish, anything else is a HandshakeError."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wire.frames import HANDSHAKE_LIMITS, Frame, FrameDecoder, MsgType, encode_frame
from wire.handshake import NONCE_BYTES, Handshake, HandshakeError

SECRET = b"s3cret-cluster-key"


def side(node_id, *, initiator, secret=SECRET, cluster="lab", info=None, nonce=None):
    return Handshake(
        secret=secret, node_id=node_id, cluster=cluster, initiator=initiator, info=info, nonce=nonce
    )


def over_the_wire(frames: list[Frame]) -> list[Frame]:
    """What the peer's decoder makes of them, under the handshake's limits."""
    data = b"".join(bytes(b) for f in frames for b in encode_frame(f, HANDSHAKE_LIMITS))
    return FrameDecoder(HANDSHAKE_LIMITS).feed(data)


def run(a: Handshake, b: Handshake):
    """Deliver frames both ways until neither side has anything to say."""
    to_b, to_a = over_the_wire(a.start()), over_the_wire(b.start())
    while to_a or to_b:
        to_b, to_a = (
            over_the_wire([out for f in to_a for out in a.receive(f)]),
            over_the_wire([out for f in to_b for out in b.receive(f)]),
        )


node_ids = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "P"]), min_size=1, max_size=64
)
infos = st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=4)


@settings(max_examples=60)
@given(node_ids, node_ids, infos, infos, st.binary(min_size=1, max_size=64))
def test_honest_sides_complete_with_each_others_ids(id_a, id_b, info_a, info_b, secret):
    if id_a == id_b:
        id_b += "-b"
    a = side(id_a, initiator=True, secret=secret, info=info_a)
    b = side(id_b, initiator=False, secret=secret, info=info_b)
    run(a, b)
    assert a.done and b.done
    assert (a.peer_id, a.peer_info) == (id_b, info_b)
    assert (b.peer_id, b.peer_info) == (id_a, info_a)


@settings(max_examples=30)
@given(st.binary(min_size=8, max_size=32), st.binary(min_size=8, max_size=32))
def test_wrong_secret_never_completes(secret_a, secret_b):
    if secret_a == secret_b:
        secret_b += b"!"
    a = side("a", initiator=True, secret=secret_a)
    b = side("b", initiator=False, secret=secret_b)
    [hello_a], [hello_b] = a.start(), b.start()
    proof_a, proof_b = a.receive(hello_b), b.receive(hello_a)
    for me, their_proof in ((a, proof_b[0]), (b, proof_a[0])):
        with pytest.raises(HandshakeError, match="different cluster secret") as e:
            me.receive(their_proof)
        assert not me.done
        assert secret_a.hex() not in str(e.value) and secret_b.hex() not in str(e.value)


# -- the state machine over (state, input) pairs
#
# The side under test is `me`; `peer` is honest. Inputs are the peer's honest
# frames, frames from another session (replays), tampered or reflected ones,
# other message types and random descriptors. `me` must finish exactly when it
# was given the peer's HELLO then the peer's PROOF, and nothing else; any other
# input is a HandshakeError, after which it stays failed.


def session(initiator: bool, nonce_seed: int):
    me = side("me", initiator=initiator, nonce=bytes([nonce_seed]) * NONCE_BYTES)
    peer = side("peer", initiator=not initiator, nonce=bytes([nonce_seed + 1]) * NONCE_BYTES)
    [my_hello], [peer_hello] = me.start(), peer.start()
    [peer_proof] = peer.receive(my_hello)
    return me, my_hello, peer_hello, peer_proof


def tampered(frame: Frame, key: str, value) -> Frame:
    return Frame(frame.type, descriptor={**frame.descriptor, key: value})


def candidate_inputs(initiator: bool) -> dict[str, Frame]:
    _, my_hello, peer_hello, peer_proof = session(initiator, nonce_seed=1)
    # The same peer in an earlier session, with other nonces: its frames are replays.
    _, _, old_hello, old_proof = session(initiator, nonce_seed=10)
    return {
        "hello": peer_hello,
        "proof": peer_proof,
        "old hello": old_hello,
        "old proof": old_proof,
        "hello, other cluster": tampered(peer_hello, "cluster", "prod"),
        "hello, other version": tampered(peer_hello, "version", 2),
        "hello, other info": tampered(peer_hello, "info", {"port": 1}),
        "hello, other node": tampered(peer_hello, "node", "mallory"),
        "hello, my own id": tampered(peer_hello, "node", "me"),
        "hello, bad nonce": tampered(peer_hello, "nonce", "AB" * NONCE_BYTES),
        "hello, short nonce": tampered(peer_hello, "nonce", "ab"),
        "hello, extra key": tampered(peer_hello, "x", 1),
        "hello with payload": Frame(MsgType.HELLO, descriptor=peer_hello.descriptor, payload=b"x"),
        "my hello reflected": my_hello,
        "proof, flipped mac": tampered(peer_proof, "mac", "00" * 32),
        "proof, mac not hex": tampered(peer_proof, "mac", "zz" * 32),
        "proof, mac number": tampered(peer_proof, "mac", 7),
        "ping": Frame(MsgType.PING),
        "forward": Frame(MsgType.FORWARD, 1, {"tensor": {}}, b"\0" * 8),
    }


INPUTS = {initiator: candidate_inputs(initiator) for initiator in (True, False)}
junk_frames = st.builds(
    Frame,
    type=st.sampled_from([MsgType.HELLO, MsgType.PROOF]),
    descriptor=st.dictionaries(
        st.sampled_from(["node", "cluster", "version", "nonce", "info", "mac"]),
        st.none() | st.integers() | st.text(max_size=70) | st.dictionaries(st.text(), st.text()),
    ),
)


# HELLOs `me` has no grounds to refuse on sight; only the "hello" it really got
# from this peer in this session makes the following "proof" verify.
PLAUSIBLE_HELLOS = {"hello", "old hello", "hello, other info", "hello, other node"}


@settings(max_examples=400)
@given(
    st.booleans(),
    st.lists(st.sampled_from(sorted(INPUTS[True])) | junk_frames, max_size=5),
)
@example(True, ["hello", "proof", "ping"])
@example(False, ["hello", "proof", "proof"])
@example(False, ["hello", "hello", "proof"])
@example(True, ["old hello", "proof"])
@example(True, ["hello", "old proof", "proof"])
@example(False, ["hello, other info", "proof"])
@example(True, ["proof", "hello"])
def test_every_input_in_every_state_advances_or_fails(initiator, script):
    me = session(initiator, nonce_seed=1)[0]
    accepted: list[str] = []
    failed = False
    for item in script:
        if failed or me.done:
            should_pass = False
        elif not accepted:
            should_pass = isinstance(item, str) and item in PLAUSIBLE_HELLOS
        else:
            should_pass = accepted == ["hello"] and item == "proof"
        frame = INPUTS[initiator][item] if isinstance(item, str) else item
        try:
            replies = me.receive(frame)
        except HandshakeError as e:
            assert not should_pass, f"{item!r} refused after {accepted}: {e}"
            assert "s3cret" not in str(e)
            failed = True
        else:
            assert should_pass, f"{item!r} accepted after {accepted}"
            accepted.append(item)
            assert [r.type for r in replies] == ([MsgType.PROOF] if len(accepted) == 1 else [])
        assert me.done == (accepted == ["hello", "proof"])


def test_pairs_of_state_and_input():
    """Spelled out for reading: the honest path, and what each stray input meets."""
    me, *_ = session(True, nonce_seed=1)
    inputs = INPUTS[True]
    with pytest.raises(HandshakeError, match="expected HELLO, got PROOF"):
        session(True, 1)[0].receive(inputs["proof"])
    with pytest.raises(HandshakeError, match="cluster 'prod'"):
        session(True, 1)[0].receive(inputs["hello, other cluster"])
    with pytest.raises(HandshakeError, match="protocol version 2"):
        session(True, 1)[0].receive(inputs["hello, other version"])
    with pytest.raises(HandshakeError, match="echoed our own nonce"):
        session(True, 1)[0].receive(inputs["my hello reflected"])
    with pytest.raises(HandshakeError, match="own id 'me'"):
        session(True, 1)[0].receive(inputs["hello, my own id"])
    with pytest.raises(HandshakeError, match="lowercase hex"):
        session(True, 1)[0].receive(inputs["hello, bad nonce"])

    assert me.receive(inputs["hello"]) != []
    with pytest.raises(HandshakeError, match="expected PROOF, got HELLO"):
        session_after_hello().receive(inputs["hello"])
    with pytest.raises(HandshakeError, match="different cluster secret"):
        session_after_hello().receive(inputs["old proof"])
    assert me.receive(inputs["proof"]) == [] and me.done
    with pytest.raises(HandshakeError, match="PING frame after the handshake completed"):
        me.receive(inputs["ping"])


def session_after_hello() -> Handshake:
    me = session(True, nonce_seed=1)[0]
    me.receive(INPUTS[True]["hello"])
    return me


def test_relayed_hello_cannot_borrow_a_mac_from_another_connection():
    """A stranger in the middle of two connections of ours, both with our secret.

    It dials us (we respond) and gets us to dial it (we initiate), then passes our
    HELLO from one connection off as its own on the other. Were that accepted, our
    initiator MAC on the outgoing connection would be exactly the proof the
    incoming one asks for.
    """
    outgoing = side("me", initiator=True)
    incoming = side("me", initiator=False)
    [hello_out], [hello_in] = outgoing.start(), incoming.start()
    with pytest.raises(HandshakeError, match="own id 'me'"):
        incoming.receive(hello_out)
    with pytest.raises(HandshakeError, match="own id 'me'"):
        outgoing.receive(hello_in)


def test_construction_errors():
    with pytest.raises(ValueError, match="secret is empty"):
        side("a", initiator=True, secret=b"")
    with pytest.raises(ValueError, match="node id ''"):
        side("", initiator=True)
    with pytest.raises(ValueError, match="node id 'x\\\\n'"):
        side("x\n", initiator=True)
    with pytest.raises(ValueError, match="make `info` smaller"):
        side("a", initiator=True, info={"blob": "x" * 2000})
    with pytest.raises(ValueError, match=f"nonce must be {NONCE_BYTES} bytes"):
        side("a", initiator=True, nonce=b"short")


def test_identity_is_hidden_until_done_and_calls_are_ordered():
    a = side("a", initiator=True)
    with pytest.raises(RuntimeError, match="not authenticated"):
        _ = a.peer_id
    with pytest.raises(RuntimeError, match="before start"):
        a.receive(Frame(MsgType.HELLO))
    a.start()
    with pytest.raises(RuntimeError, match="twice"):
        a.start()
