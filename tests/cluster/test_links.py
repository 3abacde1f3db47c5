"""The peer table over real loopback TCP: tie-breaking, heartbeats, death and return."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from ringd.cluster.links import MAX_FAILED_HANDSHAKES, Links
from ringd.cluster.memberinfo import MemberInfo
from wire import stream as wire_stream
from wire.frames import Frame, MsgType

# A spinning event loop (the bug the second test guards against) never returns
# to Python's signal handlers; only the thread method of pytest-timeout ends it.
pytestmark = pytest.mark.timeout(30, method="thread")

SECRET = b"membership-secret-0123456789abcdef"


def links(node: str, **kw) -> Links:
    got: list[tuple[str, Frame]] = []
    link = Links(node, "lab", SECRET, MemberInfo(), on_frame=lambda p, f: got.append((p, f)), **kw)
    link.got = got
    return link


async def until(predicate, timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_two_nodes_dialing_each_other_keep_the_link_dialed_by_the_smaller_id():
    async def main():
        a, b = links("a"), links("b")
        pa, pb = await a.listen("127.0.0.1", 0), await b.listen("127.0.0.1", 0)
        a.dial("127.0.0.1", pb)
        b.dial("127.0.0.1", pa)
        await until(lambda: "b" in a.peers and "a" in b.peers, what="both linked")
        # The second connection arrives and loses the tie (both ends hold both until it drains).
        await until(lambda: len(a._streams) == 2 and len(b._streams) == 2, what="the second connection")
        assert a.peers["b"].outbound and not b.peers["a"].outbound
        a.send("b", Frame(MsgType.CONTROL, 0, {"n": 1}))
        await until(lambda: any(f.type == MsgType.CONTROL for _, f in b.got), what="the frame")
        await a.close()
        await b.close()

    uvloop.run(main())


def test_a_link_read_by_a_busy_compute_thread_is_not_dead_for_its_silence_until_the_thread_waits_on_it():
    """A stage's link lent to its compute thread is read only while that thread waits on it: a
    long computation leaves the peer's heartbeats unread in the kernel, which is no silence of
    the peer's. Once the thread waits on the link and still nothing comes, the peer is dead."""

    async def main():
        a = links("a", heartbeat_interval_s=0.05, dead_after_s=0.3)
        pa = await a.listen("127.0.0.1", 0)
        mute = await wire_stream.connect("127.0.0.1", pa, secret=SECRET, node_id="mute", cluster="lab")
        await until(lambda: "mute" in a.peers, what="linked")
        await until(lambda: a.peers["mute"].stream._protocol._handler is not None, what="served")
        lent = a.lend("mute", lambda frame: True, lambda: None, lambda: None)
        assert lent is not None and not lent.waiting  # lent, and its borrower computes
        rounds = a.heartbeat_rounds
        # Three times dead_after_s in heartbeat rounds, counted by a's own loop: mute stays.
        await until(lambda: a.heartbeat_rounds >= rounds + 3 * 6, what="eighteen heartbeat rounds")
        assert "mute" in a.peers
        lent.waiting = True  # the borrower waits on the link now, and nothing comes
        await until(lambda: "mute" not in a.peers, 3.0, "a to declare the mute peer dead")
        await asyncio.wait_for(mute.wait_closed(), 2.0)
        assert lent.asked_back  # the link ended: its reading is asked back
        await a.close()

    uvloop.run(main())


def test_a_peer_vanishing_while_both_its_links_are_up_is_forgotten_and_the_loop_keeps_running():
    # Regression: b's dial loop (its dialed link lost the tie) used to wait for
    # the winning link with `await stream.wait_closed()`. When both sockets
    # closed in one loop iteration, the winner was closed but not yet removed,
    # that wait returned without yielding, and the loop spun forever: the node
    # stopped sending heartbeats and was declared dead by everyone else.
    async def main():
        for _ in range(3):
            a, b = links("a"), links("b")
            pa, pb = await a.listen("127.0.0.1", 0), await b.listen("127.0.0.1", 0)
            b.dial("127.0.0.1", pa)
            a.dial("127.0.0.1", pb)
            await until(lambda: "b" in a.peers and "a" in b.peers, what="both linked")
            # Both connections up; b's own is draining (LINK_SWAP_GRACE_S).
            await until(lambda: len(a._streams) == 2, what="both connections up")
            # a goes away at once, as a killed process does. The draining link
            # closes first, so b's dial loop wakes before the winner's reader.
            winner = a.peers["b"].stream
            (draining,) = a._streams - {winner}
            draining.close()
            winner.close()
            await a.close()
            await until(lambda: "a" not in b.peers, 3.0, "b to forget a")
            # A spinning dial loop would hold b's event loop: a fresh node linking with b
            # proves that b still accepts, handshakes and runs its links.
            c = links("c")
            c.dial("127.0.0.1", pb)
            await until(lambda: "c" in b.peers, 5.0, "a fresh node to link with b")
            await c.close()
            await b.close()

    uvloop.run(main())


def test_a_silent_peer_is_declared_dead_and_its_link_closed():
    async def main():
        a = links("a", heartbeat_interval_s=0.05, dead_after_s=0.3)
        pa = await a.listen("127.0.0.1", 0)
        # Taken before the link exists, so the time until it is declared dead can only be
        # longer than what a measured, and a slow machine cannot make it look early.
        t0 = time.monotonic()
        # A peer that authenticates and then says nothing, like a SIGSTOP'd process.
        mute = await wire_stream.connect("127.0.0.1", pa, secret=SECRET, node_id="mute", cluster="lab")
        await until(lambda: "mute" in a.peers, what="linked")
        await until(lambda: "mute" not in a.peers, 3.0, "a to declare the mute peer dead")
        silent = time.monotonic() - t0
        assert silent >= a.dead_after_s, f"declared dead after {silent:.3f} s of silence, before dead_after_s ({a.dead_after_s} s)"
        await asyncio.wait_for(mute.wait_closed(), 2.0)
        await a.close()

    uvloop.run(main())


def test_a_learned_address_whose_handshakes_fail_is_given_up_and_a_configured_one_is_not():
    async def main():
        stranger = Links("x", "lab", b"another-secret-0123456789abcdef", MemberInfo(), on_frame=lambda p, f: None)
        port = await stranger.listen("127.0.0.1", 0)
        # Every handshake a's dials fail, as the stranger's listener counts it (this process's).
        failed_before = wire_stream.EVENTS["failed handshakes"]

        def failed() -> int:
            return wire_stream.EVENTS["failed handshakes"] - failed_before

        a = links("a")
        a.dial("127.0.0.1", port)  # learned: from an advert or gossip
        await until(lambda: ("127.0.0.1", port) not in a._dialing, 10.0, "the learned dial to be given up")
        assert a._learned == 0
        a.dial("127.0.0.1", port, persistent=True)  # configured: keeps trying
        # The learned dial's MAX_FAILED_HANDSHAKES, then more than a learned one would ever try.
        more = MAX_FAILED_HANDSHAKES + MAX_FAILED_HANDSHAKES + 1
        await until(lambda: failed() >= more, 10.0, f"{more} failed handshakes at the stranger")
        assert ("127.0.0.1", port) in a._dialing
        await a.close()
        await stranger.close()

    uvloop.run(main())


def test_learned_dials_are_capped(monkeypatch, caplog):
    import logging

    import ringd.cluster.links as membership

    monkeypatch.setattr(membership, "MAX_LEARNED_DIALS", 2)

    async def main():
        a = links("a")
        for port in (1, 2, 3):  # nothing listens there: the loops keep trying
            a.dial("127.0.0.1", port)
        assert len(a._dialing) == 2 and a._learned == 2
        a.dial("127.0.0.1", 4, persistent=True)  # configured peers are never refused
        assert len(a._dialing) == 3
        await a.close()

    with caplog.at_level(logging.WARNING, "ringd.cluster.links"):
        uvloop.run(main())
    assert "not dialing 127.0.0.1:3: 2 learned addresses are being dialed already" in caplog.text


def test_a_member_that_dialed_in_is_dialed_back_once_its_link_is_lost():
    """If a flood holds this node's listener, the link must not wait for the peer's dial to get in."""

    async def main():
        a, b = links("a"), links("b")
        pa, pb = await a.listen("127.0.0.1", 0), await b.listen("127.0.0.1", 0)
        b.info = MemberInfo(addr=f"127.0.0.1:{pb}")
        # b's link to a, dialed by hand: nothing on b's side dials a again once it is gone.
        inbound = await wire_stream.connect("127.0.0.1", pa, secret=SECRET, node_id="b", cluster="lab", info=b.info.to_wire())
        await until(lambda: "b" in a.peers and not a.peers["b"].outbound, what="a to accept b")
        inbound.close()
        await until(lambda: "b" in a.peers and a.peers["b"].outbound, 5.0, "a to dial b back")
        assert "a" in b.peers and not b.peers["a"].outbound
        await a.close()
        await b.close()

    uvloop.run(main())


def test_members_addresses_are_configured_peers_and_addresses_linked_before(monkeypatch):
    import ringd.cluster.links as membership

    monkeypatch.setattr(membership, "MAX_KNOWN_HOSTS", 2)

    async def main():
        a = links("a")
        pa = await a.listen("127.0.0.1", 0)
        a.dial("10.9.9.9", 1, persistent=True)  # a configured peer: known before any link
        a.dial("10.8.8.8", 1)  # learned (an advert anyone can make): not until it links
        assert a._known_host("10.9.9.9") and not a._known_host("10.8.8.8") and not a._known_host("127.0.0.1")
        for name, addr in [("b", "::ffff:10.0.0.2:5"), ("c", "10.0.0.3:5")]:
            peer = await wire_stream.connect("127.0.0.1", pa, secret=SECRET, node_id=name, cluster="lab", info={"addr": addr})
            await until(lambda: name in a.peers, what=f"{name} linked")
            peer.close()
            await until(lambda: name not in a.peers, what=f"{name} gone")
        # Where c dials from and where it listens; b's listening address, the oldest, forgotten.
        assert a._known_host("127.0.0.1") and a._known_host("10.0.0.3") and not a._known_host("10.0.0.2")
        assert a._known_host("10.9.9.9")  # configured peers never are
        await a.close()

    uvloop.run(main())


def test_a_node_whose_first_dial_found_no_listener_takes_the_link_its_peer_dialed_and_dials_no_second(caplog):
    # Regression (found by tools/bench --link): a node started first dials a peer not yet
    # listening; the peer starts and dials it; the first node's retry made a second link,
    # which won the tie and swapped the link a loaded ring runs on: the ring broke at start.
    async def main():
        import socket

        with socket.socket() as s:  # a port with no listener yet
            s.bind(("127.0.0.1", 0))
            port_b = s.getsockname()[1]
        a = links("a")
        a.info = MemberInfo(addr=f"127.0.0.1:{await a.listen('127.0.0.1', 0)}")
        b = links("b")
        b.info = MemberInfo(addr=f"127.0.0.1:{port_b}")
        caplog.set_level("DEBUG", logger="ringd.cluster.links")
        a.dial("127.0.0.1", port_b)  # refused: nothing listens there yet
        await until(lambda: f"dial 127.0.0.1:{port_b} failed" in caplog.text, what="a's first dial to fail")
        await b.listen("127.0.0.1", port_b)
        b.dial("127.0.0.1", int(a.info.addr.rsplit(":", 1)[1]))
        await until(lambda: a.waiting_on.get(("127.0.0.1", port_b)) == "b", what="a's dial loop waiting on b's link")
        assert not a.peers["b"].outbound and len(a._streams) == 1 and len(b._streams) == 1
        await a.close()
        await b.close()

    uvloop.run(main())
