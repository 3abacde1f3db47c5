"""ringd.node.holders: a node with no model finds who holds one by probing, and never joins by it.

Real ``Links`` listeners on loopback, each with the INFO a daemon gives; the probe
runs the real handshake.
"""

from __future__ import annotations

import asyncio

import uvloop

from ringd.node.holders import holder_of, probe
from ringd.cluster.links import Links
from ringd.cluster.memberinfo import MemberInfo
from ringd.models.peers import Holder
from wire import stream as wire_stream

SECRET = b"x" * 32


def holder(node, said, model=None):
    """holder_of over an INFO as a peer sent it (a JSON object), parsed as a link parses it."""
    return holder_of(node, MemberInfo.parse(said), model)


def test_what_an_info_says_of_its_node():
    info = {"files": True, "model": "fp1", "http": "10.0.0.2:8100"}
    assert holder("node2", info) == Holder("node2", "10.0.0.2:8100", "fp1")
    assert holder("node2", info, "fp1") == Holder("node2", "10.0.0.2:8100", "fp1")
    assert holder("node2", info, "fp2") is None  # another model
    assert holder("node2", {**info, "https": True}) == Holder("node2", "10.0.0.2:8100", "fp1", https=True)  # its API is TLS
    assert holder("node2", {**info, "files": False}) is None  # holds none whole
    assert holder("node2", {**info, "http": "nowhere"}) is None
    assert holder("node2", {"files": True, "model": "fp1"}) is None
    assert holder("no de", info) is None


def test_a_probe_reads_holders_and_joins_nobody():
    async def main():
        changes = []  # (listener, its peer table) at every change, so a join that left again still shows

        def links(node, secret, info):
            n = Links(node, "lab", secret, MemberInfo.parse(info), on_frame=lambda p, f: None)
            n.on_change = lambda: changes.append((node, set(n.peers)))
            return n

        holder = links("node0", SECRET, {"files": True, "model": "fp", "http": "127.0.0.1:8100"})
        plain = links("node1", SECRET, {"files": False, "model": "fp", "http": "127.0.0.1:8101"})
        stranger = links("node9", b"y" * 32, {"files": True, "model": "fp", "http": "127.0.0.1:8109"})
        # The members' listeners are done with the probe once their handler for its (authenticated)
        # connection has returned: wrapped here, around the real one, to see that happen.
        handled: dict[str, asyncio.Event] = {}
        for n in (holder, plain):
            handled[n.node] = done = asyncio.Event()

            async def accepted(stream, real=n._accepted, done=done):
                await real(stream)
                if stream.peer_id == "newcomer":
                    done.set()

            n._accepted = accepted
        # The stranger's is done once it has counted the probe's failed handshake.
        failed_before = wire_stream.EVENTS["failed handshakes"]
        ports = [await n.listen("127.0.0.1", 0) for n in (holder, plain, stranger)]
        try:
            found = await probe([("127.0.0.1", p) for p in ports] + [("127.0.0.1", 1)], secret=SECRET, node="newcomer", cluster="lab", encrypt=False)
            async with asyncio.timeout(10):
                for done in handled.values():
                    await done.wait()
                while wire_stream.EVENTS["failed handshakes"] == failed_before:
                    await asyncio.sleep(0.01)
            return found, [set(n.peers) for n in (holder, plain, stranger)], changes
        finally:
            for n in (holder, plain, stranger):
                n.on_change = lambda: None  # closing is no part of what the probe did
                await n.close()

    found, tables, changes = uvloop.run(main())
    assert found == [Holder("node0", "127.0.0.1:8100", "fp")]  # not the one without files, nor the stranger's
    assert tables == [set(), set(), set()]
    assert not [c for c in changes if "newcomer" in c[1]], f"the probe joined a peer table: {changes}"
    assert changes == [], f"the peer tables changed during a probe: {changes}"
