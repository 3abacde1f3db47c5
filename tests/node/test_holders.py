"""ringd.node.holders: a node with no model finds who holds one by probing, and never joins by it.

Real ``Links`` listeners on loopback, each with the INFO a daemon gives; the probe
runs the real handshake.
"""

from __future__ import annotations

import asyncio

import uvloop

from ringd.node.holders import holder_of, probe
from ringd.cluster.links import Links
from ringd.models.peers import Holder

SECRET = b"x" * 32


def test_what_an_info_says_of_its_node():
    info = {"files": True, "model": "fp1", "http": "10.0.0.2:8100"}
    assert holder_of("node2", info) == Holder("node2", "10.0.0.2:8100", "fp1")
    assert holder_of("node2", info, "fp1") == Holder("node2", "10.0.0.2:8100", "fp1")
    assert holder_of("node2", info, "fp2") is None  # another model
    assert holder_of("node2", {**info, "files": False}) is None  # holds none whole, or ring_encryption
    assert holder_of("node2", {**info, "http": "nowhere"}) is None
    assert holder_of("node2", {"files": True, "model": "fp1"}) is None
    assert holder_of("no de", info) is None


def test_a_probe_reads_holders_and_joins_nobody():
    async def main():
        holder = Links("node0", "lab", SECRET, {"files": True, "model": "fp", "http": "127.0.0.1:8100"}, on_frame=lambda p, f: None)
        plain = Links("node1", "lab", SECRET, {"files": False, "model": "fp", "http": "127.0.0.1:8101"}, on_frame=lambda p, f: None)
        stranger = Links("node9", "lab", b"y" * 32, {"files": True, "model": "fp", "http": "127.0.0.1:8109"}, on_frame=lambda p, f: None)
        ports = [await n.listen("127.0.0.1", 0) for n in (holder, plain, stranger)]
        try:
            found = await probe([("127.0.0.1", p) for p in ports] + [("127.0.0.1", 1)], secret=SECRET, node="newcomer", cluster="lab", encrypt=False)
            await asyncio.sleep(0.2)  # the window in which a probe that joined would show in the tables
            return found, [set(n.peers) for n in (holder, plain, stranger)]
        finally:
            for n in (holder, plain, stranger):
                await n.close()

    found, tables = uvloop.run(main())
    assert found == [Holder("node0", "127.0.0.1:8100", "fp")]  # not the one without files, nor the stranger's
    assert tables == [set(), set(), set()]
