"""Discovery over real mDNS: python-zeroconf, real sockets, real multicast, no mocks.

Two networks, both of which only ever carry the test's own traffic:

- loopback in this namespace: every zeroconf here is bound to ``lo`` only, so
  nothing reaches another interface. Linux's ``lo`` has no MULTICAST flag, yet
  python-zeroconf works on it because it sets IP_MULTICAST_IF per socket and the
  kernel loops the packets back; no flag and no route are needed.
- three network namespaces on a bridge (``tests/kit/netns.py``), one child process
  per namespace, each a ``python -m ringd.cluster.discovery``, as on three machines.

Every test uses a cluster name of its own, so adverts of other test runs on the
same loopback are ignored like any other cluster's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from zeroconf import ServiceInfo, Zeroconf
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from devkit.netns import NetnsHosts, netns_available
from ringd.cluster.discovery import (
    SERVICE_TYPE,
    TXT_KEYS,
    Advert,
    Discovery,
    dial_order,
    host_name,
    instance_label,
    local_addresses,
    local_networks,
    order_addresses,
)
from wire.frames import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = ["lo"]  # the only interface the in-process tests speak mDNS on
# Registration probes for ~2 s, discovery takes a few hundred ms more.
FIND_TIMEOUT_S = 10.0


def cluster_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


async def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


def node(name: str, cluster: str, ring_port: int, found: dict, **kwargs) -> Discovery:
    found[name] = []
    return Discovery(
        node=name, cluster=cluster, ring_port=ring_port, http_port=ring_port + 1000,
        addresses=["127.0.0.1"], on_peer=found[name].append, interfaces=LOOPBACK, **kwargs,
    )  # fmt: skip


# --- the pure parts: ordering addresses, adverts to records and back -----------------

PAIRS = [
    ("lo", "127.0.0.1"),
    ("en0", "192.168.1.20"),
    ("bridge0", "169.254.10.2"),
    ("en1", "10.0.0.5"),
    ("bridge1", "169.254.20.2"),
    ("utun3", "100.64.0.9"),
    ("en0", "fe80::1"),  # not IPv4: dropped
]


def test_order_without_preference_keeps_routable_then_link_local_and_drops_loopback():
    assert order_addresses(PAIRS) == [
        ("en0", "192.168.1.20"),
        ("en1", "10.0.0.5"),
        ("utun3", "100.64.0.9"),
        ("bridge0", "169.254.10.2"),
        ("bridge1", "169.254.20.2"),
    ]


def test_order_follows_the_preference_list_with_globs_and_networks():
    ordered = order_addresses(PAIRS, ["bridge*", "en1", "100.64.0.0/10"])
    assert ordered == [
        ("bridge0", "169.254.10.2"),
        ("bridge1", "169.254.20.2"),
        ("en1", "10.0.0.5"),
        ("utun3", "100.64.0.9"),
        ("en0", "192.168.1.20"),
    ]
    assert order_addresses(PAIRS, ["en9", "bridge1"])[0] == ("bridge1", "169.254.20.2")  # unknown names are harmless


def test_loopback_only_when_alone_or_asked_for():
    assert order_addresses([("lo", "127.0.0.1")]) == [("lo", "127.0.0.1")]
    assert order_addresses(PAIRS, include_loopback=True)[-1] == ("lo", "127.0.0.1")
    assert order_addresses([("lo", "127.0.0.1")], include_loopback=False) == []
    assert order_addresses([("lo", "127.0.0.1")], ["lo"]) == [("lo", "127.0.0.1")]


def test_an_address_on_two_interfaces_is_listed_once():
    assert order_addresses([("en0", "10.0.0.5"), ("en1", "10.0.0.5"), ("en2", "10.0.0.6")]) == [
        ("en0", "10.0.0.5"),
        ("en2", "10.0.0.6"),
    ]


def test_dial_order_puts_addresses_on_our_networks_first():
    nets = [ipaddress.IPv4Network("192.168.1.0/24"), ipaddress.IPv4Network("127.0.0.0/8")]
    # The peer prefers its bridge, but this host is not on it: its LAN address first.
    assert dial_order(["169.254.10.2", "192.168.1.20"], nets) == ["192.168.1.20", "169.254.10.2"]
    # Two on our networks keep the peer's order; none: the peer's order as is.
    assert dial_order(["127.0.0.1", "192.168.1.20"], nets) == ["127.0.0.1", "192.168.1.20"]
    assert dial_order(["10.0.0.5", "10.0.1.5"], nets) == ["10.0.0.5", "10.0.1.5"]
    assert any(ipaddress.IPv4Address("127.0.0.1") in n for n in local_networks())


def test_local_addresses_reads_this_host():
    pairs = local_addresses(include_loopback=True)
    assert pairs and all(ipaddress.ip_address(ip).version == 4 for _, ip in pairs)
    assert ("lo", "127.0.0.1") in pairs
    assert local_addresses(["lo"], include_loopback=True)[0] == ("lo", "127.0.0.1")
    others = local_addresses()
    assert others == [p for p in pairs if p[0] != "lo"] or others == [("lo", "127.0.0.1")]


def service_info(advert: Advert, a_records: list[str] | None = None, txt: dict | None = None, port=None) -> ServiceInfo:
    return ServiceInfo(
        SERVICE_TYPE,
        f"{instance_label(advert.node, advert.cluster)}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton(a) for a in (a_records if a_records is not None else advert.addresses)],
        port=advert.ring_port if port is None else port,
        properties=advert.to_txt() if txt is None else txt,
        server=host_name(advert.node, advert.cluster),
    )


ADVERT = Advert("mini1", "home", PROTOCOL_VERSION, ("169.254.3.1", "192.168.1.20", "10.0.0.5"), 50051, 8100)


def test_advert_round_trips_and_keeps_the_advertised_order():
    # mDNS caches do not keep record order; the TXT `addrs` restores it.
    info = service_info(ADVERT, a_records=["10.0.0.5", "192.168.1.20", "169.254.3.1"])
    assert Advert.from_service_info(info) == ADVERT


def test_a_records_are_the_truth_and_txt_only_orders_them():
    info = service_info(ADVERT, a_records=["10.0.0.5", "192.168.1.20", "10.9.9.9"])
    assert Advert.from_service_info(info).addresses == ("192.168.1.20", "10.0.0.5", "10.9.9.9")


@pytest.mark.parametrize(
    "change,why",
    [
        ({"txt": {k: v for k, v in ADVERT.to_txt().items() if k != "cluster"}}, "no 'cluster'"),
        ({"txt": {**ADVERT.to_txt(), "proto": "one"}}, "proto='one' is not a decimal number"),
        ({"txt": {**ADVERT.to_txt(), "proto": "-1"}}, "not a decimal number"),
        ({"txt": {**ADVERT.to_txt(), "http": "99999"}}, "http_port must be a port number"),
        ({"txt": {**ADVERT.to_txt(), "node": "bad name!"}}, "node 'bad name!' must be"),
        ({"txt": {**ADVERT.to_txt(), "node": "é"}}, "not ASCII"),
        ({"txt": {**ADVERT.to_txt(), "addrs": "10.0.0.5,mini1.local"}}, "'mini1.local' is not an IPv4 address"),
        ({"a_records": []}, "no A records"),
        ({"a_records": ["224.0.0.251"]}, "cannot be dialed"),
        ({"port": 0}, "ring_port must be a port number"),
    ],
)
def test_malformed_records_are_rejected_with_a_reason(change, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace("?", r"\?")):
        Advert.from_service_info(service_info(ADVERT, **change))


def test_txt_holds_exactly_the_public_keys_and_no_secret():
    secret = b"correct-horse-battery-staple-0123456789"  # what a daemon holds; Discovery never takes it
    d = Discovery(node="mini1", cluster="home", ring_port=50051, http_port=8100, addresses=["10.0.0.5"], on_peer=print)
    assert set(d.info.properties) == {k.encode() for k in TXT_KEYS}
    assert secret not in d.info.text and b"secret" not in d.info.text
    assert d.info.name == f"mini1@home.{SERVICE_TYPE}" and d.info.server.startswith("ringd-")


# --- one machine, loopback ---------------------------------------------------------


def test_three_nodes_find_each_other_on_loopback():
    cluster = cluster_name()
    found: dict[str, list[Advert]] = {}

    async def main():
        nodes = [node(f"n{i}", cluster, 41000 + i, found) for i in range(3)]
        await asyncio.gather(*(d.start() for d in nodes))
        try:
            await wait_until(lambda: all(len(d.peers) == 2 for d in nodes), FIND_TIMEOUT_S, f"{found}")
            assert all(d.advertising for d in nodes)
            for d in nodes:
                others = {o.advert for o in nodes if o is not d}
                assert set(d.peers.values()) == others, f"{d.advert.node} sees {d.peers}"
                assert set(found[d.advert.node]) == others  # on_peer told it too, never about itself
            assert nodes[0].peers["n1"] == Advert("n1", cluster, PROTOCOL_VERSION, ("127.0.0.1",), 41001, 42001)
        finally:
            await asyncio.gather(*(d.stop() for d in nodes))
        assert all(not d._tasks and d._aiozc is None for d in nodes)

    asyncio.run(main())


def test_other_clusters_versions_and_malformed_adverts_are_ignored(caplog):
    caplog.set_level(logging.DEBUG, logger="ringd.cluster.discovery")
    cluster = cluster_name()
    found: dict[str, list[Advert]] = {}
    secret = b"never-in-a-txt-record-0123456789"
    good = Advert("good", cluster, PROTOCOL_VERSION, ("127.0.0.1",), 41101, 42101)
    strangers = {
        "other cluster": Advert("alien", cluster_name(), PROTOCOL_VERSION, ("127.0.0.1",), 41102, 42102),
        "other version": Advert("future", cluster, PROTOCOL_VERSION + 1, ("127.0.0.1",), 41103, 42103),
    }

    async def main():
        me = node("me", cluster, 41100, found)
        # Hand-made adverts, as other software (or another ringd version) would send them.
        other = AsyncZeroconf(interfaces=["127.0.0.1"])
        infos = [service_info(a) for a in (good, *strangers.values())]
        infos.append(service_info(Advert("broken", cluster, 1, ("127.0.0.1",), 41104, 0), txt={"node": "broken"}))
        try:
            for info in infos:
                await other.async_register_service(info, cooperating_responders=True)  # skip probing: fast
            await me.start()
            await wait_until(lambda: "good" in me.peers, FIND_TIMEOUT_S, "the good advert")
            ignored = [f"ignoring advert {info.name}" for info in infos[1:]]
            await wait_until(
                lambda: all(any(r.getMessage().startswith(w) for r in caplog.records) for w in ignored),
                FIND_TIMEOUT_S,
                f"ignoring all three strangers; log:\n{caplog.text}",
            )
            assert found["me"] == [good]
            assert me.peers == {"good": good}
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any("protocol version" in w and "future" in w for w in warnings), warnings

            # What the LAN sees of us: the public keys, and no secret.
            seen = AsyncServiceInfo(SERVICE_TYPE, me.info.name)
            assert await seen.async_request(other.zeroconf, 3000)
            assert set(seen.properties) == {k.encode() for k in TXT_KEYS}
            assert secret not in seen.text
            assert seen.parsed_addresses() == ["127.0.0.1"] and seen.port == 41100
        finally:
            await me.stop()
            await other.async_close()

    asyncio.run(main())


def test_a_duplicate_node_id_is_warned_about_and_does_not_crash(caplog):
    caplog.set_level(logging.INFO, logger="ringd.cluster.discovery")
    cluster = cluster_name()
    found: dict[str, list[Advert]] = {}

    async def main():
        first = node("twin", cluster, 41200, found)
        await first.start()
        second = Discovery(
            node="twin", cluster=cluster, ring_port=41201, http_port=42201,
            addresses=["127.0.0.1"], on_peer=print, interfaces=LOOPBACK,
        )  # fmt: skip
        peer = node("peer", cluster, 41202, found)
        try:
            await asyncio.gather(second.start(), peer.start())
            assert first.advertising and not second.advertising
            assert any("already advertises node id 'twin'" in r.getMessage() for r in caplog.records), caplog.text
            # The second keeps browsing: it still finds the others.
            await wait_until(lambda: "peer" in second.peers, FIND_TIMEOUT_S, "the peer, by the unadvertised twin")
        finally:
            await asyncio.gather(first.stop(), second.stop(), peer.stop())

    asyncio.run(main())


def test_stop_while_starting_neither_hangs_nor_advertises(monkeypatch):
    probing = asyncio.Event()
    check_service = Zeroconf.async_check_service

    async def check_service_seen(zc, *args, **kwargs):
        # Registration has begun: zeroconf probes the name (~2 s) before it registers it.
        probing.set()
        return await check_service(zc, *args, **kwargs)

    monkeypatch.setattr(Zeroconf, "async_check_service", check_service_seen)

    async def main():
        d = node("hasty", cluster_name(), 41300, {})
        starting = asyncio.create_task(d.start())
        await asyncio.wait_for(probing.wait(), FIND_TIMEOUT_S)
        assert not d.advertising  # inside the probing: stopped before any advert went out
        await asyncio.wait_for(d.stop(), 5)
        await asyncio.wait_for(starting, 5)
        assert not d.advertising and not d._tasks

    asyncio.run(main())


# --- three hosts: network namespaces on a bridge -----------------------------------


def read_events(procs: list[subprocess.Popen], done, timeout: float) -> list[list[dict]]:
    """JSON lines from each process's stdout until done(events), or AssertionError at the deadline."""
    events: list[list[dict]] = [[] for _ in procs]
    partial = [b"" for _ in procs]
    by_fd = {p.stdout.fileno(): i for i, p in enumerate(procs)}
    deadline = time.monotonic() + timeout
    while not done(events):
        left = deadline - time.monotonic()
        exited = [p.args for p in procs if p.poll() is not None]
        if left <= 0 or exited:
            raise AssertionError(f"not done within {timeout} s (exited: {exited}); events: {events}")
        for fd in select.select(list(by_fd), [], [], min(left, 0.5))[0]:
            i = by_fd[fd]
            # os.read, not readline: a buffered reader would hide lines select cannot see.
            *lines, partial[i] = (partial[i] + os.read(fd, 65536)).split(b"\n")
            events[i] += [json.loads(line) for line in lines]
    return events


def test_three_hosts_in_network_namespaces_find_each_other(tmp_path):
    reason = netns_available()
    assert reason is None, f"cannot build test hosts: {reason}"
    cluster = cluster_name()
    logs = [tmp_path / f"host{i}.log" for i in range(3)]
    with NetnsHosts(3) as net, contextlib.ExitStack() as files:
        logs = [files.enter_context(open(log, "w+")) for log in logs]
        procs = [
            net.popen(
                i,
                [sys.executable, "-m", "ringd.cluster.discovery", "--node", f"host{i}", "--cluster", cluster,
                 "--ring-port", str(50051 + i), "--http-port", "8100", "--seconds", "30", "--log-level", "info"],
                cwd=REPO, stdout=subprocess.PIPE, stderr=logs[i],
            )  # fmt: skip
            for i in range(len(net.hosts))
        ]

        def peers(evs: list[dict]) -> dict[str, dict]:
            return {e["node"]: e for e in evs if e["event"] == "peer"}

        def complete(evs: list[dict]) -> bool:  # peers may be found before the node's own advert is up
            return len(peers(evs)) == 2 and any(e["event"] == "ready" for e in evs)

        try:
            events = read_events(procs, lambda all_events: all(map(complete, all_events)), 20.0)
        except AssertionError as e:
            for log in logs:
                log.seek(0)
            raise AssertionError(f"{e}\n" + "\n".join(f"--- host{i} log:\n{log.read()[-3000:]}" for i, log in enumerate(logs)))
        for i, host in enumerate(net.hosts):
            ready = next(e for e in events[i] if e["event"] == "ready")
            assert ready["advertising"] and ready["addresses"] == [host.ip], ready  # its own netns IP, not loopback
            expected = {
                f"host{j}": {
                    "event": "peer", "node": f"host{j}", "cluster": cluster, "proto": PROTOCOL_VERSION,
                    "addresses": [other.ip], "ring_port": 50051 + j, "http_port": 8100,
                }  # fmt: skip
                for j, other in enumerate(net.hosts)
                if j != i
            }
            assert peers(events[i]) == expected, f"{host.name} saw {events[i]}"
    names = {h.name for h in net.hosts} | {net.bridge_ns}
    assert not names & set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert all(p.poll() is not None for p in procs)
