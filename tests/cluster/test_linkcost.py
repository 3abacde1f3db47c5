"""ringd.cluster.linkcost: RTT and bandwidth from heartbeat echoes, on simulated clocks
(Hypothesis) and between two in-process members over real loopback TCP."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from ringd.cluster import linkcost
from ringd.cluster.election import Announce, Pin, Term
from ringd.cluster.linkcost import MIN_RTT_SAMPLES, PROBE_BYTES, PROBE_INTERVAL_S, RTT_SAMPLES, LinkMeter
from ringd.cluster.memberinfo import MemberInfo
from ringd.cluster.members import Cluster, ClusterSettings
from ringd.cluster.messages import Heartbeat, MessageError
from ringd.cluster.reconcile import Report
from ringd.base.tasks import Supervisor

pytestmark = pytest.mark.timeout(60, method="thread")


class Wire:
    """Two meters exchanging heartbeats over a simulated link: one-way ``delay`` s, ``rate`` bytes/s
    for a probe's payload, each side holding what it hears ``hold`` s before its next beat."""

    def __init__(self):
        self.a, self.b = LinkMeter("a", 64), LinkMeter("b", 64)
        self.now = 1000.0

    def exchange(self, delay: float, hold: float, rate: float | None = None) -> None:
        beat = self.a.stamp(self.now)
        transfer = beat.probe / rate if (beat.probe and rate) else 0.0
        self.now += delay + transfer
        self.b.heard("a", self.now, beat)
        self.now += hold
        back = self.b.stamp(self.now)
        self.now += delay
        self.a.heard("b", self.now, back)
        self.now += 0.01


@given(st.floats(1e-5, 0.05), st.lists(st.floats(0, 1.0), min_size=RTT_SAMPLES + 1, max_size=3 * RTT_SAMPLES))
def test_rtt_is_both_ways_on_the_wire_whatever_the_peer_held_it(delay, holds):
    w = Wire()
    for hold in holds:
        w.exchange(delay, hold)
    m = w.a.measured("b")
    assert m is not None and abs(m.rtt_us - 2 * delay * 1e6) <= 2  # float rounding to whole µs


@given(st.floats(1e-4, 0.01), st.integers(0, RTT_SAMPLES - 2), st.floats(0.05, 0.5))  # within one probe interval
def test_a_few_slow_samples_do_not_move_the_rtt(delay, slow, stall):
    w = Wire()
    w.exchange(delay, 0.1)  # the first beat is a probe: no RTT sample
    for i in range(RTT_SAMPLES):
        w.exchange(delay + (stall if i < slow else 0.0), 0.1)
    assert abs(w.a.measured("b").rtt_us - 2 * delay * 1e6) <= 2


def test_no_figure_until_enough_samples():
    w = Wire()
    for _ in range(MIN_RTT_SAMPLES):  # the first beat is a probe, before any RTT: no sample
        w.exchange(0.001, 0.1)
    assert w.a.measured("b") is None and w.a.view() == {}
    w.exchange(0.001, 0.1)
    assert w.a.view()["b"].rtt_us == 2000


@given(st.floats(1e-4, 0.005), st.sampled_from([3e6, 12.5e6, 125e6]))
def test_a_probe_measures_bandwidth_and_a_fast_link_has_none(delay, rate):
    w = Wire()
    for _ in range(RTT_SAMPLES + 1):
        w.exchange(delay, 0.1)  # the first beat was a probe, before any RTT: no rate from it
    w.now += PROBE_INTERVAL_S
    w.exchange(delay, 0.1, rate)
    m = w.a.measured("b")
    assert m.bandwidth is not None and abs(m.bandwidth - rate) / rate < 0.01
    fast = Wire()
    for _ in range(RTT_SAMPLES + 1):
        fast.exchange(delay, 0.1)
    fast.now += PROBE_INTERVAL_S
    fast.exchange(delay, 0.1, 40e9)  # Thunderbolt: 64 KiB in 1.6 µs, under the RTT's resolution
    assert fast.a.measured("b").bandwidth is None


def test_probes_are_bounded_in_bytes_a_minute():
    m = LinkMeter("a", 64)
    sent = sum(m.stamp(1000.0 + 0.5 * i).probe for i in range(120))  # a minute of beats at 0.5 s
    assert sent <= linkcost.PROBE_BYTES_PER_MIN + PROBE_BYTES  # the first beat probes at once


def test_heartbeats_without_the_new_fields_still_parse_and_bad_ones_are_refused():
    beat = Heartbeat(Announce(Term(1, "a"), "a", Pin()), Report(), {})
    d = beat.to_wire()
    assert "clock" not in d and "links" not in d and Heartbeat.from_wire(d) == beat
    for bad in ({"t": "x", "echo": {}}, {"t": 1.0, "echo": {"b": [1.0]}}, {"t": float("inf"), "echo": {}}, {"t": 1.0}):
        with pytest.raises(MessageError):
            Heartbeat.from_wire({**d, "clock": bad})
    for bad in ({"b": [0, None]}, {"b": [10, -1]}, {"b": [1.5, None]}, {"b": [True, None]}, {"x" * 300: [10, None]}):
        with pytest.raises(MessageError):
            Heartbeat.from_wire({**d, "links": bad})


class Quiet:
    """A node that owns a Cluster and does nothing with what it hears (cluster.members.Owner)."""

    def on_frame(self, peer, frame): ...
    def on_leadership(self, leading): ...
    def on_change(self): ...
    def reports(self):
        return Report(), ()
    def serving(self):
        return None, ""
    def kept_models(self):
        return ()
    def sent(self, seconds): ...


def test_members_measure_each_other_over_real_tcp_and_report_to_each_other(tmp_path, monkeypatch):
    monkeypatch.setattr(linkcost, "PROBE_INTERVAL_S", 0.2)

    async def main():
        sup = Supervisor()

        def member(node: str) -> Cluster:
            settings = ClusterSettings(node, "lab", tmp_path / f"{node}.json", heartbeat_interval_s=0.02, dead_after_s=5.0)
            return Cluster(settings, b"linkcost-secret-0123456789abcdef", MemberInfo(), sup, Quiet())

        a, b = member("a"), member("b")
        await a.links.listen("127.0.0.1", 0)
        pb = await b.links.listen("127.0.0.1", 0)
        a.links.dial("127.0.0.1", pb)
        deadline = time.monotonic() + 20
        # Evidence: a's own figure for b, and b's figure for a as b's heartbeats report it to a.
        while not (a.meter.measured("b") and a.link_views().get("b", {}).get("a")):
            assert time.monotonic() < deadline, "no RTT figures within 20 s"
            await asyncio.sleep(0.02)
        rtt = a.meter.measured("b").rtt_us
        assert 0 < rtt < 1_000_000  # loopback: well under a second, however loaded the machine
        assert set(a.link_views()) == {"a", "b"}
        # Two nodes that listen on one host talk over loopback: its round trip is scheduling, not
        # a link, and placement gets no figure for it (a loaded CI machine left nodes out).
        a.links.info, a.links.peers["b"].info = MemberInfo(addr="127.0.0.1:7001"), MemberInfo(addr="127.0.0.1:7002")
        assert a.link_views() == {"a": {}, "b": {}}
        a.links.peers["b"].info = MemberInfo(addr="10.0.0.2:7002")  # another machine
        assert a.link_views()["a"]["b"] and a.link_views()["b"]["a"]
        await a.links.close()
        await b.links.close()
        await sup.stop()

    uvloop.run(main())
