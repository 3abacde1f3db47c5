"""What each link costs: round-trip time and bandwidth to every peer, from the heartbeats.

Sans-I/O: the caller passes ``now`` (its monotonic clock, seconds) and the
clock part of every heartbeat it sends and hears; nothing here sleeps, reads a
clock or touches a socket, so the arithmetic is tested as pure functions.

RTT needs no synchronised clocks. Every heartbeat carries the sender's send
time ``t`` and, for each peer it heard from since its last beat, that peer's
``t`` and how long it held it before echoing (``held``). When our own ``t``
comes back, ``now - t - held`` is the time on the wire both ways plus the
peer's reading of the frame: one RTT sample per heartbeat interval, on frames
the link sends anyway. A link's RTT is the second fastest of its last RTT_SAMPLES
samples, which slow samples (an event loop busy with a prefill chunk, a frame
queued behind a FORWARD) do not move unless all but one are slow.

Bandwidth: every PROBE_INTERVAL_S one heartbeat carries PROBE_BYTES of payload
(ignored by the receiver, older versions included). Its echo comes back later
than a bare beat's by about the time those bytes took on the wire, so
``PROBE_BYTES / (probe RTT - RTT)`` estimates the link's rate. Where the
difference is below what the RTT's own spread resolves (loopback, Thunderbolt)
the link is "faster than a probe measures" (None), which placement reads as
no cost beyond its RTT.

It knows nothing of plans or placement: ``topology.py`` turns these figures
into ring orders.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

# Samples a link's RTT is taken from: 9 heartbeats (4.5 s at the default
# interval) follow a link that changes within seconds.
RTT_SAMPLES = 9
# A link's RTT is the second fastest of its samples. A sample is the wire both
# ways plus whatever kept either end from reading the beat at once (its event
# loop busy with a prefill chunk, a CPU shared with other work, a switch's queue),
# which only ever adds; nothing makes a beat faster than the wire. So the fastest
# samples are the link's own figure: on this project's shared 2-core VM, over the
# link emulator, the median of a 50 us Thunderbolt link's samples read 3-4 ms and
# the lower quartile 3 ms, all of it reading delays, which would hide a Wi-Fi
# link's extra 2 ms. The second, not the first: one beat timed wrong cannot make it.
RTT_RANK = 1
# A link's RTT is reported once its window is full: a figure from fewer samples
# may all come from the seconds a node was busy (starting, loading layers; on the
# shared VM a wired host's first three read 16 ms against 3.5 ms) and could re-plan a ring.
MIN_RTT_SAMPLES = RTT_SAMPLES
# Bandwidth probes: PROBE_BYTES of heartbeat payload every PROBE_INTERVAL_S, on
# every link: 64 KiB every 15 s is 256 KiB a minute per link (PROBE_BYTES_PER_MIN),
# 0.003% of a 1 GbE link and 0.1% of a slow 30 Mb/s Wi-Fi link, and the probe
# takes 17 ms on that Wi-Fi link: a hidden-state hop waits behind it at most that
# once every 15 s. 64 KiB is several hops' worth of hidden states (a 4096-wide
# bf16 row is 8 KiB), so it measures the rate hops see rather than one packet's.
PROBE_BYTES = 64 * 1024
PROBE_INTERVAL_S = 15.0
PROBE_BYTES_PER_MIN = PROBE_BYTES * 60 / PROBE_INTERVAL_S
# Bandwidth samples a link's rate is the median of.
BANDWIDTH_SAMPLES = 5
# A probe RTT less than this above the link's RTT says only that the link is fast:
# below it the difference is the RTT's own jitter, and dividing by it gives noise.
MIN_PROBE_EXTRA_S = 200e-6
# Probe beats remembered until their echo comes back; older ones (their link closed) are forgotten.
PROBES_KEPT = 4
# An echo held longer than this is stale (the peer's loop stalled, or it was a
# beat from a link since re-made): the sample would measure the stall, not the link.
MAX_HELD_S = 5.0


@dataclass(frozen=True)
class Clock:
    """The clock part of a heartbeat: when it was sent, and the echoes it carries.

    ``t``: the sender's monotonic clock at sending (seconds). ``echo``: peer ->
    (that peer's ``t`` as heard, seconds held before this beat). ``probe``: bytes
    of probe payload this beat carries (0: none).
    """

    t: float
    echo: dict[str, tuple[float, float]]
    probe: int = 0


@dataclass(frozen=True)
class Measured:
    """One link as one end measures it: RTT in microseconds, bytes a second (None: unmeasured, or
    faster than a probe resolves)."""

    rtt_us: int
    bandwidth: int | None = None


class _Link:
    def __init__(self):
        self.rtts: deque[float] = deque(maxlen=RTT_SAMPLES)
        # Bytes a second per probe; inf for a probe back too soon to measure (a fast link).
        self.rates: deque[float] = deque(maxlen=BANDWIDTH_SAMPLES)

    def measured(self) -> Measured | None:
        if len(self.rtts) < MIN_RTT_SAMPLES:
            return None
        rate = statistics.median(self.rates) if self.rates else math.inf
        return Measured(max(1, round(self.rtt() * 1e6)), None if math.isinf(rate) else int(rate))

    def rtt(self) -> float:
        return sorted(self.rtts)[min(RTT_RANK, len(self.rtts) - 1)]


class LinkMeter:
    """One node's measurements of its links. Feed it every heartbeat sent (``stamp``) and heard
    (``heard``); read ``measured`` for each peer's figures."""

    def __init__(self, node: str, max_peers: int):
        self.node = node
        self.max_peers = max_peers  # echoes one heartbeat carries at most (its bound on peers)
        self._heard: dict[str, tuple[float, float]] = {}  # peer -> (its t, when we heard it)
        self._links: dict[str, _Link] = {}
        self._probes: dict[float, int] = {}  # our t of a probe beat -> its payload bytes
        self._last_probe = -math.inf

    def stamp(self, now: float) -> Clock:
        """The clock of the heartbeat sent now: echoes of every beat heard since the last one,
        and a probe every PROBE_INTERVAL_S."""
        echo = {}
        for peer, (t, heard) in list(self._heard.items())[: self.max_peers]:
            held = now - heard
            if 0 <= held <= MAX_HELD_S:
                echo[peer] = (t, held)
        self._heard.clear()
        probe = 0
        if now - self._last_probe >= PROBE_INTERVAL_S:
            self._last_probe, probe = now, PROBE_BYTES
            self._probes[now] = probe
            while len(self._probes) > PROBES_KEPT:
                del self._probes[next(iter(self._probes))]
        return Clock(now, echo, probe)

    def heard(self, peer: str, now: float, clock: Clock) -> None:
        """A heartbeat from ``peer`` arrived (whole) at ``now`` with ``clock``."""
        self._heard[peer] = (clock.t, now)
        mine = clock.echo.get(self.node)
        if mine is None:
            return
        t, held = mine
        rtt = now - t - held
        if not (0 <= rtt <= MAX_HELD_S and 0 <= held <= MAX_HELD_S):
            return  # not a time we sent (a restarted peer echoing a beat of our last life)
        link = self._links.setdefault(peer, _Link())
        probe = self._probes.get(t)
        if not probe:
            link.rtts.append(rtt)
            return
        if len(link.rtts) < MIN_RTT_SAMPLES:
            return  # nothing yet to tell the payload's share from the RTT
        extra = rtt - link.rtt()
        link.rates.append(probe / extra if extra >= MIN_PROBE_EXTRA_S else math.inf)

    def measured(self, peer: str) -> Measured | None:
        """``peer``'s link as measured from here; None until it has MIN_RTT_SAMPLES samples."""
        link = self._links.get(peer)
        return link.measured() if link is not None else None

    def view(self) -> dict[str, Measured]:
        """Every measured link, at most ``max_peers`` of them: what a heartbeat reports to the leader."""
        out = {}
        for peer in sorted(self._links):
            m = self._links[peer].measured()
            if m is not None and len(out) < self.max_peers:
                out[peer] = m
        return out

    def forget(self, peer: str) -> None:
        """``peer``'s link closed: a new link is a new path, measured afresh."""
        self._links.pop(peer, None)
        self._heard.pop(peer, None)
