"""The link emulator (tests/kit/linkshape.py): its model, and real TCP through it between namespaces."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devkit.linkshape import PROFILES, LinkModel, Profile, profile
from devkit.netns import NetnsHosts, netns_available

profiles = st.sampled_from(sorted(PROFILES.values(), key=lambda p: p.name))


@given(hosts=st.lists(st.tuples(profiles, st.integers(0, 1)), min_size=2, max_size=4), uplink=profiles,
       sends=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(20, 9000), st.floats(0, 1e-3)), min_size=1, max_size=50),
       seed=st.integers(0, 2**32))
@settings(max_examples=200, deadline=None)
def test_a_packet_arrives_no_sooner_than_its_path_allows_and_a_pair_stays_in_order(hosts, uplink, sends, seed):
    links, segments = [p for p, _ in hosts], [s for _, s in hosts]
    model = LinkModel(links, seed, segments, uplink)
    now, last = 0.0, {}
    for src, dst, size, gap in sends:
        src, dst = src % len(links), dst % len(links)
        if src == dst:
            continue
        now += gap
        path = model.path(src, dst)
        assert len(path) == (2 if segments[src] == segments[dst] else 3)
        at = model.deliver_at(src, dst, size, now)
        if at is None:
            assert any(link.loss for link in path)
            continue
        # Each access link is half crossed (half its latency, half its jitter), the uplink whole.
        shares = [0.5, 0.5] if len(path) == 2 else [0.5, 1.0, 0.5]
        floor = sum(max(share * (link.latency_s - link.jitter_s), 0.0) for link, share in zip(path, shares))
        assert at >= now + floor + sum(8 * size / link.rate_bps for link in path) - 1e-12
        assert at >= last.get((src, dst), 0.0)  # in order
        last[(src, dst)] = at


def test_hosts_on_two_segments_need_an_uplink():
    with pytest.raises(ValueError, match="no uplink"):
        LinkModel([profile("1gbe")] * 2, segments=[0, 1])


def test_back_to_back_packets_leave_at_the_links_rate_and_a_lossy_link_loses_its_share():
    slow = Profile("slow", 0.0, 0.0, 0.0, 8e6, 1500)  # one byte a microsecond
    model = LinkModel([slow, slow])
    ats = [model.deliver_at(0, 1, 1000, 0.0) for _ in range(100)]
    assert ats[-1] == pytest.approx(100 * 1000e-6 + 1000e-6)  # serialized up, then down
    # Two pairs across a slow uplink share its one direction; the other direction is free.
    fast = Profile("fast", 0.0, 0.0, 0.0, 8e9, 9000)
    shared = LinkModel([fast] * 4, segments=[0, 0, 1, 1], uplink=slow)
    ats = [shared.deliver_at(src, src + 2, 1000, 0.0) for src in (0, 1) * 50]
    assert max(ats) == pytest.approx(100 * 1000e-6, rel=0.01)
    assert shared.deliver_at(2, 0, 1000, 0.0) == pytest.approx(1000e-6, rel=0.01)
    lossy = LinkModel([profile("wifi"), profile("1gbe")], seed=7)
    lost = sum(lossy.deliver_at(0, 1, 100, i * 1e-3) is None for i in range(20000))
    assert 60 <= lost <= 140  # 0.5% of 20000 is 100


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="thunderbolt"):
        profile("carrier pigeon")


_ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], 9000))
print("listening", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(1)):
    c.sendall(d)
"""
_PING = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 9000), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
best = 1.0
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); best = min(best, time.perf_counter() - t)
print(best)
"""


def test_tcp_between_shaped_hosts_takes_the_links_round_trip():
    missing = netns_available()
    assert missing is None, missing
    # Host 2 is on another switch, across a 10 GbE uplink.
    with NetnsHosts(3, links=["1gbe", "wifi", "1gbe"], segments=[0, 0, 1], uplink="10gbe") as net:
        server = net.popen(1, [sys.executable, "-c", _ECHO, net.hosts[1].ip], stdout=subprocess.PIPE)
        assert server.stdout.readline().strip() == b"listening"
        def best_round_trip(i: int) -> float:
            out = subprocess.run(net.exec_prefix(0) + [sys.executable, "-c", _PING, net.hosts[i].ip],
                                 capture_output=True, text=True, timeout=60, check=True)
            return float(out.stdout)

        wifi, wired, uplink = profile("wifi"), profile("1gbe"), profile("10gbe")
        # The best of 20 round trips: two crossings of both links, jitter at its kindest.
        over_wifi = best_round_trip(1)
        assert over_wifi >= 2 * (wifi.latency_s / 2 + wired.latency_s / 2 - wifi.jitter_s / 2)
        # Between the two wired hosts no Wi-Fi is crossed, but the uplink is, both ways.
        server2 = net.popen(2, [sys.executable, "-c", _ECHO, net.hosts[2].ip], stdout=subprocess.PIPE)
        assert server2.stdout.readline().strip() == b"listening"
        over_uplink = best_round_trip(2)
        assert 2 * (wired.latency_s + uplink.latency_s) <= over_uplink < over_wifi
