"""Who may hold a listening ring port's handshake slots: sans-I/O slot accounting.

Every connection `serve` accepts holds a slot from the moment it is accepted
until its handshake ends (authenticated, failed, or past HANDSHAKE_TIMEOUT_S).
The slots bound memory, a decoder and a transport per connection; they must not
decide who gets in. An attack probe (issue 14) filled them with stalled HELLOs
from strangers, and a link between two members that had dropped could not be
re-made until the flood stopped.

So the slots are split by the connection's source address into two pools:

  strangers  addresses this node has no reason to expect. At most `strangers`
             at once, `per_stranger_host` from one address; one more is
             refused (closed at once). First come, first served: a stranger has
             no claim to a place, and refusing it costs nothing.
  known      addresses of members (configured peers, addresses linked before:
             the caller says which, `serve`'s `trusted`). At most `known` at
             once, and a known address is never refused: when the pool is full,
             the oldest connection of the address holding the most (the arriving
             address first among equals) is closed to make room.

Why this holds up against an attacker. Strangers from any number of addresses
fill only their own pool: they never stand in a member's way. An attacker on a
member's address (behind the same NAT, on the same Mac) is known too, but it
is only that address: what it holds, it loses first, since the address holding
the most gives up a connection, and within an address the oldest goes. A
member's dial is the newest of its address and done in milliseconds; to close
it, the attacker must open about `known` connections from that address within
those milliseconds, and even then only dials from that address suffer. Another
address loses a connection only when it holds at least as many as the
arriving one: an honest address, holding one or two, only when `known`
different members' addresses are in the handshake at the same moment.

The other options fail alone: a reserved pool is filled by an attacker on a
member's address, and refusing strangers first does nothing against one (it
is no stranger). Dialing out helps, and the daemon re-makes a lost link from
both ends (ringd.cluster.links), but the far end's listener may be flooded too.

Memory stays bounded whatever the caller trusts: at most `strangers + known`
connections are held, whatever the number of addresses.
"""

import collections
import ipaddress
import itertools
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")  # what identifies a connection: the stream layer uses its protocol objects


def canonical_host(host: str) -> str:
    """One spelling per address, so one address is counted (and trusted) as one.

    A dual-stack listener sees an IPv4 peer as ``::ffff:a.b.c.d``; IPv6 has many
    spellings of one address. Anything that is not an IP address is lower-cased.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


@dataclass(frozen=True)
class SlotLimits:
    strangers: int  # connections from strangers in the handshake at once
    per_stranger_host: int  # of those, from one address
    known: int  # connections from known addresses in the handshake at once

    def __post_init__(self):
        if not 1 <= self.per_stranger_host <= self.strangers or self.known < 1:
            raise ValueError(
                f"slot limits must be at least 1, per_stranger_host at most strangers: {self}"
            )


@dataclass(frozen=True)
class Admission(Generic[K]):
    admitted: bool
    evict: K | None = None  # a known connection to close now: its slot went to the new one


class HandshakeSlots(Generic[K]):
    """The slots of one listener: admit on accept, release when the handshake ends."""

    def __init__(self, limits: SlotLimits):
        self.limits = limits
        self._holders: dict[K, tuple[str, bool]] = {}  # key -> (address, known)
        self._strangers: collections.Counter[str] = collections.Counter()
        # By address, each address's connections oldest first with their admission
        # number (to find the oldest among addresses holding equally many).
        self._known: dict[str, dict[K, int]] = {}
        self._admitted = itertools.count()

    def held(self, known: bool) -> int:
        """Connections in the handshake from known addresses, or from strangers."""
        return sum(1 for _, k in self._holders.values() if k == known)

    def held_from(self, host: str) -> int:
        host = canonical_host(host)
        return sum(1 for h, _ in self._holders.values() if h == host)

    def admit(self, key: K, host: str, known: bool) -> Admission[K]:
        """Whether connection `key` from `host` may start the handshake; what to close for it.

        `known`: `host` is a member's address (the caller's judgment, made now).
        """
        assert key not in self._holders, f"{key!r} was admitted already"
        host = canonical_host(host)
        if not known:
            if (
                len(self._holders) - self._known_total() >= self.limits.strangers
                or self._strangers[host] >= self.limits.per_stranger_host
            ):
                return Admission(False)
            self._strangers[host] += 1
            self._holders[key] = (host, False)
            return Admission(True)
        evict = None
        if self._known_total() >= self.limits.known:
            evict = self._victim(host)
            self.release(evict)
        self._known.setdefault(host, {})[key] = next(self._admitted)
        self._holders[key] = (host, True)
        return Admission(True, evict)

    def release(self, key: K) -> None:
        """The handshake of `key` ended (or it was evicted); a key not held is ignored."""
        held = self._holders.pop(key, None)
        if held is None:
            return
        host, known = held
        if known:
            del self._known[host][key]
            if not self._known[host]:
                del self._known[host]
        else:
            self._strangers[host] -= 1
            if not self._strangers[host]:
                del self._strangers[host]

    def _known_total(self) -> int:
        return sum(len(conns) for conns in self._known.values())

    def _victim(self, arriving: str) -> K:
        """The oldest connection of the address holding the most; `arriving` first among equals."""

        def claim(host: str) -> tuple:
            conns = self._known[host]
            return len(conns), host == arriving, -next(iter(conns.values()))

        host = max(self._known, key=claim)
        return next(iter(self._known[host]))
