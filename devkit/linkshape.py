"""Links as Macs have them, on one Linux machine: a userspace link emulator for NetnsHosts.

The kernels this project is tested on (CI's included) are built without netem
(CONFIG_NET_SCH_NETEM is not set; tc has only tbf and htb here), so a link's latency,
jitter and loss cannot be asked of tc. Instead each shaped host's ``eth0`` is a TUN
device whose other end is held by one emulator process (run inside the bridge's
namespace, so nothing appears in the root namespace): it reads every IPv4 packet a
host sends, and writes it into the destination host's TUN when the link model says it
arrives, or never (lost). The hosts' own kernels run real TCP over it: a lost segment
is retransmitted as on a real Wi-Fi link, a slow link fills the socket buffers.

The model (``LinkModel``, sans-I/O) gives each host one access link, a ``Profile``:
a packet from A to B is serialized at A's rate onto A's link, crosses A's and B's
links (half of each one's one-way latency, plus half of each one's jitter), is
serialized at B's rate off B's link, and is lost with each link's loss probability.
So two hosts of one profile see its latency one way, as a Mac sees a switch's other
port. Hosts may sit on SEGMENTS (switches, Thunderbolt bridges, rooms) joined by one
UPLINK, itself a ``Profile`` whose latency and jitter are those of crossing it once: a
packet between hosts of different segments also crosses the uplink (serialized at its
rate, each direction shared by every packet that crosses it that way; its whole latency
and jitter; its loss). So the path, not just the two ends, decides what a pair's link
costs, and a ring's order can cross the uplink more or less often. Packets between one
pair of hosts are delivered in the order they were sent (jitter never reorders: a Wi-Fi
link's does not either, and reordering would make TCP retransmit for nothing).
Multicast and broadcast (mDNS) go to every other host.

The emulator adds its own cost (a Python process reading and writing each packet:
tens of microseconds); ``tools/bench --link`` measures each link's round trip through
it and puts the measured figure beside the profile's in its theory.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """One kind of link between a Mac and the rest of the network."""

    name: str
    latency_s: float  # one way, between two hosts of this profile
    jitter_s: float  # uniform in [-jitter, +jitter] added per packet (clipped at 0)
    loss: float  # probability a packet crossing this link is lost
    rate_bps: float  # the link's bit rate
    mtu: int  # bytes: jumbo frames on wired links cut the emulator's packets per byte


# What each kind of link is, roughly, between two Macs (issue 31). Wired rates are what
# the hardware signals; what the emulator moves is far less (one Python process):
# tools/bench measures and reports it.
PROFILES = {
    "thunderbolt": Profile("thunderbolt", 50e-6, 0.0, 0.0, 40e9, 9000),
    "10gbe": Profile("10gbe", 100e-6, 0.0, 0.0, 10e9, 9000),
    "1gbe": Profile("1gbe", 250e-6, 0.0, 0.0, 1e9, 1500),
    "wifi": Profile("wifi", 2e-3, 1e-3, 0.005, 300e6, 1500),
}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; one of {', '.join(PROFILES)}") from None


class LinkModel:
    """When (if ever) a packet sent now arrives: sans-I/O, the emulator's whole policy.

    ``links``: each host's access link. ``segments``: each host's segment (None: one
    segment); hosts of different segments are joined by ``uplink``."""

    def __init__(self, links: list[Profile], seed: int = 0, segments: list[int] | None = None, uplink: Profile | None = None):
        self.links = links
        self.segments = [0] * len(links) if segments is None else list(segments)
        if len(self.segments) != len(links):
            raise ValueError(f"{len(self.segments)} segments for {len(links)} hosts; give one per host")
        if uplink is None and len(set(self.segments)) > 1:
            raise ValueError(f"hosts on segments {sorted(set(self.segments))} and no uplink to join them")
        self.uplink = uplink
        self.rng = random.Random(seed)
        self._up_free = [0.0] * len(links)  # when each host's link is free to send again
        self._down_free = [0.0] * len(links)  # when each host's link is free to deliver again
        self._uplink_free = {}  # (from segment, to segment): when that direction is free again
        self._last = {}  # (src, dst): the last delivery time, so a pair stays in order

    def path(self, src: int, dst: int) -> tuple[Profile, ...]:
        """The links a packet from ``src`` to ``dst`` crosses, in order."""
        a, b = self.links[src], self.links[dst]
        return (a, b) if self.segments[src] == self.segments[dst] else (a, self.uplink, b)

    def deliver_at(self, src: int, dst: int, size: int, now: float) -> float | None:
        path = self.path(src, dst)
        if any(self.rng.random() < link.loss for link in path):
            return None
        a, b = path[0], path[-1]
        sent = max(now, self._up_free[src]) + 8 * size / a.rate_bps
        self._up_free[src] = sent
        at = sent + self._flight(a, 0.5)
        if len(path) == 3:
            way = (self.segments[src], self.segments[dst])
            at = max(at, self._uplink_free.get(way, 0.0)) + 8 * size / self.uplink.rate_bps
            self._uplink_free[way] = at
            at += self._flight(self.uplink, 1.0)
        at += self._flight(b, 0.5)
        arrive = max(at, self._down_free[dst]) + 8 * size / b.rate_bps
        self._down_free[dst] = arrive
        arrive = max(arrive, self._last.get((src, dst), 0.0))
        self._last[(src, dst)] = arrive
        return arrive

    def _flight(self, link: Profile, share: float) -> float:
        """``share`` of ``link``'s one-way latency, and of a jitter draw (never below 0)."""
        jitter = self.rng.uniform(-link.jitter_s, link.jitter_s) if link.jitter_s else 0.0
        return max(share * (link.latency_s + jitter), 0.0)


# --- the emulator process ----------------------------------------------------------------

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MAX_PACKET = 65536
# Below this a wait is spun rather than slept: select's sleep overshoots by the
# kernel's timer slack (50 us by default) and a Thunderbolt hop is 50 us.
_SPIN_S = 100e-6


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def _timer_slack_1ns() -> None:
    # The default 50 us slack would add up to 50 us to every timed wakeup.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    except OSError:
        pass


def _destinations(packet: bytes, prefix: bytes, src: int, n: int) -> list[int]:
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return []  # IPv4 only: the hosts have no IPv6 addresses on eth0
    dst = packet[16:20]
    if dst[:3] == prefix and 1 <= dst[3] <= n:
        return [] if dst[3] - 1 == src else [dst[3] - 1]
    if dst[0] >= 224 or dst[3] == 255:  # multicast (mDNS) or broadcast
        return [i for i in range(n) if i != src]
    return []


def run(names: list[str], model: LinkModel, prefix: bytes) -> None:
    """Create one TUN per host (named ``names``), say "ready", then forward as ``model`` says
    until stdin closes."""
    _timer_slack_1ns()
    fds = [_open_tun(name) for name in names]
    src_of = {fd: i for i, fd in enumerate(fds)}
    due: list[tuple[float, int, int, bytes]] = []  # (time, order, dst, packet)
    order = 0
    print("ready", flush=True)
    watch = [*fds, sys.stdin.fileno()]
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, dst, packet = heapq.heappop(due)
            try:
                os.write(fds[dst], packet)
            except OSError:
                pass  # the host's interface is down or gone: as a cable pulled
        wait = None if not due else max(0.0, due[0][0] - time.monotonic())
        if wait is not None and wait < _SPIN_S:
            ready, _, _ = select.select(watch, [], [], 0)
        else:
            ready, _, _ = select.select(watch, [], [], wait)
        for fd in ready:
            if fd not in src_of:
                if not os.read(fd, 4096):
                    return  # our parent closed our stdin: the hosts are being torn down
                continue
            src = src_of[fd]
            while True:
                try:
                    packet = os.read(fd, _MAX_PACKET)
                except BlockingIOError:
                    break
                now = time.monotonic()
                for dst in _destinations(packet, prefix, src, len(fds)):
                    at = model.deliver_at(src, dst, len(packet), now)
                    if at is not None:
                        order += 1
                        heapq.heappush(due, (at, order, dst, packet))


def main() -> None:
    p = argparse.ArgumentParser(description="the link emulator NetnsHosts(links=...) runs; see the module docstring")
    p.add_argument("--names", required=True, help="TUN names, comma-separated, one per host")
    p.add_argument("--links", required=True, help="JSON list of Profile fields, one per host")
    p.add_argument("--prefix", required=True, help="the hosts' /24, as A.B.C")
    p.add_argument("--segments", help="each host's segment, comma-separated integers (default: one segment)")
    p.add_argument("--uplink", help="JSON of the Profile fields of the link joining the segments")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    links = [Profile(**d) for d in json.loads(args.links)]
    segments = None if args.segments is None else [int(x) for x in args.segments.split(",")]
    uplink = None if args.uplink is None else Profile(**json.loads(args.uplink))
    prefix = bytes(int(x) for x in args.prefix.split("."))
    run(args.names.split(","), LinkModel(links, args.seed, segments, uplink), prefix)


def encode(links: list[Profile] | Profile) -> str:
    """``links`` (a list, or one) as JSON of their fields: what ``--links`` and ``--uplink`` read."""
    if isinstance(links, Profile):
        return json.dumps(dataclasses.asdict(links))
    return json.dumps([dataclasses.asdict(link) for link in links])


if __name__ == "__main__":
    main()
