"""Find the other daemons of this cluster on the LAN with mDNS/DNS-SD (Bonjour).

Every daemon advertises one ``_ringd._tcp.local.`` service with python-zeroconf's
asyncio API: the A records carry its IPv4 addresses, the SRV record its ring port,
the TXT record its node id, cluster name, protocol version, HTTP port and the
order in which it prefers its addresses to be dialed. Every daemon also browses for
the others and hands each valid advert to ``on_peer``; the caller dials the
advertised IPs (``membership.Links.dial``), which is also where the cluster
secret is proven.

What this module deliberately ignores:

- Host names. The SRV record must name a host, so it names a made-up one
  (``ringd-<hash>.local.``), but peers take the addresses from the A records that
  come in the same response and never resolve a ``.local`` name through DNS (that
  failed on real networks before). The made-up name also keeps us from answering
  for the Mac's own Bonjour host name, which is often the default node id.
- Adverts of other clusters, of other protocol versions, our own advert, and
  malformed records: logged (at debug, or once as a warning when a user can act on
  it), never raised out of the browser callback.
- IPv6. The ring dials IPv4; Thunderbolt bridges and home LANs have it.
- Departures. A peer whose advert goes away is not reported: membership notices
  the dead link sooner and for certain.
- Secrets. Anyone on the LAN can read a TXT record; the cluster secret only ever
  travels as an HMAC inside the ring handshake.
- Static ``peers:`` and gossip: the daemon dials those itself.

``python -m ringd.cluster.discovery`` advertises and prints the adverts it finds as JSON
lines: a check that multicast works on a network, and the tests' child process.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import hashlib
import ipaddress
import json
import logging
import signal
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, NonUniqueNameException, ServiceInfo, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from ringd.base.names import DEFAULT_HTTP_PORT, DEFAULT_RING_PORT, check_name
from wire.frames import PROTOCOL_VERSION

log = logging.getLogger(__name__)

SERVICE_TYPE = "_ringd._tcp.local."

# Registering probes the network for our instance name first (RFC 6762 section 8.1);
# python-zeroconf 0.154 waits 150-250 ms, then sends 3 probes 500 ms apart: about
# 1.8 s. The rest is slack for a loaded machine.
REGISTER_TIMEOUT_S = 10.0
# How long one advert's SRV, TXT and A records may take to arrive once its PTR
# is seen. Responders answer within 20-120 ms (RFC 6762 section 6) and usually send
# them along with the PTR, so 3 s is several retries (python-zeroconf's default).
LOOKUP_TIMEOUT_MS = 3000  # ms
# Stopping sends three goodbyes 125 ms apart (RFC 6762 section 10.1), then closes
# the sockets.
STOP_TIMEOUT_S = 3.0
# Lookups in flight at once. A ring has a handful of nodes; a LAN flooded with
# fake adverts must not grow tasks without bound. Adverts past this are dropped
# and found again at the browser's next query.
MAX_PENDING_LOOKUPS = 64
# A TXT string holds at most 255 bytes (RFC 6763 section 6.1); 8 dotted quads and
# their commas take at most 127 of them, and no Mac has more useful addresses.
MAX_ADVERTISED_ADDRESSES = 8
# The longest instance name label (RFC 6763 section 4.1.1).
MAX_INSTANCE_LABEL_BYTES = 63
# The TXT keys, all required. Unknown keys are ignored (RFC 6763 section 6.4),
# so a later version can add some without breaking this one.
TXT_KEYS = ("node", "cluster", "proto", "http", "addrs")
# Longest decimal string accepted for the proto and http TXT values: ample for a
# port or a version, and int() never sees a hostile thousand-digit number.
MAX_TXT_INT_DIGITS = 9


class DiscoveryError(RuntimeError):
    """Discovery cannot run on this host (no mDNS sockets, no such interface)."""


def _check_ipv4(address: str) -> str:
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        raise ValueError(f"{address!r} is not an IPv4 address") from None
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ValueError(f"{address} cannot be dialed (unspecified, multicast or broadcast)")
    return str(ip)


def _check_port(port: object, what: str, allow_zero: bool = False) -> int:
    lowest = 0 if allow_zero else 1
    if type(port) is not int or not lowest <= port <= 65535:
        raise ValueError(f"{what} must be a port number from {lowest} to 65535; got {port!r}")
    return port


@dataclass(frozen=True)
class Advert:
    """What one daemon tells the LAN about itself. Validated on construction."""

    node: str
    cluster: str
    proto: int
    addresses: tuple[str, ...]  # IPv4, in the advertiser's order of preference
    ring_port: int
    http_port: int  # 0: this node serves no HTTP API

    def __post_init__(self) -> None:
        for what, value in (("node", self.node), ("cluster", self.cluster)):
            try:
                check_name(value)
            except ValueError as e:
                raise ValueError(f"{what} {value!r} {e}") from None
        if type(self.proto) is not int or self.proto < 0:
            raise ValueError(f"proto must be a non-negative integer; got {self.proto!r}")
        if not isinstance(self.addresses, tuple) or not self.addresses:
            raise ValueError("addresses must be a non-empty tuple of IPv4 addresses")
        if len(self.addresses) > MAX_ADVERTISED_ADDRESSES:
            raise ValueError(f"{len(self.addresses)} addresses; at most {MAX_ADVERTISED_ADDRESSES} fit in an advert")
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"addresses {self.addresses} repeat one")
        for address in self.addresses:
            if _check_ipv4(address) != address:
                raise ValueError(f"address {address!r} is not in dotted-quad form")
        _check_port(self.ring_port, "ring_port")
        _check_port(self.http_port, "http_port", allow_zero=True)

    def to_txt(self) -> dict[str, str]:
        """The TXT record. Everything in it is public: never put a secret here."""
        return {
            "node": self.node,
            "cluster": self.cluster,
            "proto": str(self.proto),
            "http": str(self.http_port),
            "addrs": ",".join(self.addresses),
        }

    @classmethod
    def from_service_info(cls, info: ServiceInfo) -> Advert:
        """The advert in a resolved ServiceInfo; ValueError says what is wrong with it.

        Addresses come from the A records (what the responder sent); the TXT
        ``addrs`` only orders them, as mDNS caches do not keep record order.
        """
        props = info.properties or {}
        txt: dict[str, str] = {}
        for key in TXT_KEYS:
            value = props.get(key.encode())
            if value is None:
                raise ValueError(f"TXT has no {key!r} value")
            try:
                txt[key] = value.decode("ascii")
            except UnicodeDecodeError:
                raise ValueError(f"TXT {key!r} is not ASCII") from None
        proto, http = (_txt_int(txt[key], key) for key in ("proto", "http"))
        a_records = [_check_ipv4(a) for a in info.parsed_addresses(IPVersion.V4Only)]
        if not a_records:
            raise ValueError("no A records (IPv4 addresses)")
        order = [_check_ipv4(a) for a in txt["addrs"].split(",")] if txt["addrs"] else []
        rank = {a: i for i, a in enumerate(order)}
        addresses = sorted(set(a_records), key=lambda a: (rank.get(a, len(rank)), ipaddress.IPv4Address(a)))
        if info.port is None:
            raise ValueError("no SRV record (ring port)")
        return cls(txt["node"], txt["cluster"], proto, tuple(addresses), info.port, http)


def _txt_int(value: str, key: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > MAX_TXT_INT_DIGITS:
        raise ValueError(f"TXT {key}={value!r} is not a decimal number")
    return int(value)


def instance_label(node: str, cluster: str) -> str:
    """The instance part of the service name: ``node@cluster``, unique per cluster.

    The cluster is in it so that two clusters on one LAN may both have a ``mini1``;
    a name too long for one label is cut and made unique with a hash.
    """
    label = f"{node}@{cluster}"
    if len(label.encode()) <= MAX_INSTANCE_LABEL_BYTES:
        return label
    digest = _digest(node, cluster)[:12]
    return f"{label[: MAX_INSTANCE_LABEL_BYTES - len(digest) - 1]}~{digest}"


def host_name(node: str, cluster: str) -> str:
    """The SRV target. Never resolved by peers; unique per (cluster, node) so two
    daemons' A records never mix in a cache, and never the Mac's own host name."""
    return f"ringd-{_digest(node, cluster)[:16]}.local."


def _digest(node: str, cluster: str) -> str:
    return hashlib.sha256(f"{cluster}\n{node}".encode()).hexdigest()


# --- this host's addresses --------------------------------------------------------


def interface_matches(pattern: str, interface: str, address: str) -> bool:
    """An interface name, a glob over names (``bridge*``), or an IPv4 network
    (``169.254.0.0/16``) or address."""
    try:
        return ipaddress.IPv4Address(address) in ipaddress.IPv4Network(pattern, strict=False)
    except ValueError:
        return fnmatch.fnmatchcase(interface, pattern)


def order_addresses(
    pairs: Iterable[tuple[str, str]], preference: Sequence[str] = (), include_loopback: bool | None = None
) -> list[tuple[str, str]]:
    """(interface, IPv4) pairs in the order peers should dial them.

    Pairs matching ``preference`` come first, in the order of the pattern they
    match first. The rest keep their given order, except that link-local ones
    (169.254/16, which Thunderbolt bridges use: kept, but often stale elsewhere)
    go after routable ones, and loopback last. Loopback is left out unless it is
    the only address or ``include_loopback`` is true; an address seen twice keeps
    its first interface. Non-IPv4 entries are dropped.
    """
    seen: set[str] = set()
    unique: list[tuple[str, ipaddress.IPv4Address]] = []
    for interface, address in pairs:
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            continue
        if str(ip) not in seen:
            seen.add(str(ip))
            unique.append((interface, ip))
    if include_loopback is None:
        include_loopback = all(ip.is_loopback for _, ip in unique)
    kept = [(i, ip) for i, ip in unique if include_loopback or not ip.is_loopback]

    def rank(pair: tuple[str, ipaddress.IPv4Address]) -> tuple[int, int]:
        interface, ip = pair
        for k, pattern in enumerate(preference):
            if interface_matches(pattern, interface, str(ip)):
                return (0, k)
        return (1, 2 if ip.is_loopback else 1 if ip.is_link_local else 0)

    return [(interface, str(ip)) for interface, ip in sorted(kept, key=rank)]


def local_addresses(preference: Sequence[str] = (), include_loopback: bool | None = None) -> list[tuple[str, str]]:
    """This host's (interface name, IPv4) pairs in dial order (see ``order_addresses``)."""
    pairs = [(a.nice_name, ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if ip.is_IPv4]
    return order_addresses(pairs, preference, include_loopback)


def local_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host has an address on."""
    return [
        ipaddress.IPv4Interface(f"{ip.ip}/{ip.network_prefix}").network
        for a in ifaddr.get_adapters()
        for ip in a.ips
        if ip.is_IPv4
    ]


def dial_order(addresses: Sequence[str], networks: Iterable[ipaddress.IPv4Network]) -> list[str]:
    """A peer's advertised addresses in the order to dial them.

    Those on a network this host is on come first, in the peer's order of
    preference; then the rest (reachable through a router, perhaps). A Mac
    that lists its Thunderbolt bridge first is dialed there only by the Macs
    on that bridge; the others use its LAN address instead of a dead one.
    """
    networks = list(networks)
    ips = [ipaddress.IPv4Address(a) for a in addresses]
    near = [ip for ip in ips if any(ip in n for n in networks)]
    return [str(ip) for ip in near + [ip for ip in ips if ip not in near]]


def lan_address() -> str:
    """The address this host uses to reach the LAN, without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only, no packet leaves
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def own_addresses(advertise: str | None, host: str, prefer_interfaces: Sequence[str]) -> list[str]:
    """The addresses peers may dial this node at, best first.

    ``advertise`` if set, else the listen address ``host`` if it is a specific
    one, else this host's IPv4 addresses: those matching ``prefer_interfaces``
    first, then the one of the default route, then the rest (loopback only if alone).
    """
    if advertise:
        return [advertise]
    if host not in ("0.0.0.0", "::"):
        return [host]
    pairs = local_addresses(prefer_interfaces)
    preferred = [ip for i, ip in pairs if any(interface_matches(p, i, ip) for p in prefer_interfaces)]
    rest = [ip for _, ip in pairs if ip not in preferred]
    route = lan_address()
    if route in rest:
        rest.remove(route)
        rest.insert(0, route)
    return preferred + rest or [route]


def _zeroconf_interfaces(interfaces: Sequence[str] | None) -> list[str] | InterfaceChoice:
    """python-zeroconf wants IPv4 addresses; accept interface names and globs too."""
    if interfaces is None:
        return InterfaceChoice.All
    pairs = [(a.nice_name, ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if ip.is_IPv4]
    chosen: list[str] = []
    for pattern in interfaces:
        for interface, address in pairs:
            if interface_matches(pattern, interface, address) and address not in chosen:
                chosen.append(address)
    if not chosen:
        have = ", ".join(f"{i} ({a})" for i, a in pairs) or "none"
        raise DiscoveryError(f"discovery interfaces {list(interfaces)} match no IPv4 address on this host; it has: {have}")
    return chosen


# --- advertise and browse ---------------------------------------------------------


class Discovery:
    """Advertise this node and report the other nodes of its cluster to ``on_peer``.

    ``on_peer(advert)`` runs on the event loop, once per new or changed advert of
    another node of the same cluster and protocol version (possibly while
    ``start()`` is still probing); it must not block.
    ``interfaces`` (names, globs or IPv4 addresses) limits where mDNS is spoken;
    by default, everywhere.
    """

    def __init__(
        self,
        *,
        node: str,
        cluster: str,
        ring_port: int,
        http_port: int,
        addresses: list[str],
        on_peer: Callable[[Advert], None],
        interfaces: list[str] | None = None,
        advertise: bool = True,
    ):
        addresses = [_check_ipv4(a) for a in addresses]
        if len(addresses) > MAX_ADVERTISED_ADDRESSES:
            log.warning("advertising the first %d of %d addresses: %s", MAX_ADVERTISED_ADDRESSES, len(addresses), addresses)
            addresses = addresses[:MAX_ADVERTISED_ADDRESSES]
        self.advert = Advert(node, cluster, PROTOCOL_VERSION, tuple(dict.fromkeys(addresses)), ring_port, http_port)
        self.on_peer = on_peer
        self.interfaces = interfaces
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{instance_label(node, cluster)}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in self.advert.addresses],
            port=ring_port,
            properties=self.advert.to_txt(),
            server=host_name(node, cluster),
        )
        self.advertise = advertise  # False: browse only (a node looking for peers before it joins)
        self.advertising = False  # False until registered, and for good after a name conflict
        self._found: dict[str, Advert] = {}  # by service instance name
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._announce: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self._warned: set[tuple] = set()

    @property
    def peers(self) -> dict[str, Advert]:
        """The adverts of the other nodes currently seen, by node id."""
        return {a.node: a for a in self._found.values()}

    async def start(self) -> None:
        """Open the mDNS sockets, browse, then advertise (probing takes about 2 s).

        Raises DiscoveryError when mDNS cannot run here; static peers still work
        then. A name conflict is logged and leaves this node browsing only.
        """
        if self._aiozc is not None:
            raise RuntimeError("discovery already started")
        zc_interfaces = _zeroconf_interfaces(self.interfaces)
        try:
            self._aiozc = AsyncZeroconf(interfaces=zc_interfaces, ip_version=IPVersion.V4Only)
        except OSError as e:
            raise DiscoveryError(
                f"cannot open mDNS sockets (UDP 5353) on {zc_interfaces}: {e}; "
                "only static peers will be dialed"
            ) from e
        try:
            await self._advertise()
        except Exception:
            if self._aiozc is None:
                return  # stop() ran while we were probing: nothing to advertise
            await self.stop()
            raise
        except BaseException:  # cancelled: close the sockets on the way out
            await self.stop()
            raise

    async def _advertise(self) -> None:
        # Browse before registering: the answers land in the cache that probing
        # checks, so a daemon already holding our name is noticed.
        self._browser = AsyncServiceBrowser(self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_state_change])
        if not self.advertise:
            return
        a = self.advert
        try:
            self._announce = await asyncio.wait_for(self._aiozc.async_register_service(self.info), REGISTER_TIMEOUT_S)
            if self._aiozc is None:
                return  # stop() ran while we were probing
            self.advertising = True
            log.info(
                "advertising %s of cluster %s at %s ring port %d", a.node, a.cluster, ",".join(a.addresses), a.ring_port
            )
        except NonUniqueNameException:
            log.warning(
                "another daemon on this network already advertises node id %r in cluster %r; "
                "node ids must be unique: set `name` in one of their configs. "
                "Not advertising; still browsing and dialing static peers",
                a.node,
                a.cluster,
            )
        except asyncio.TimeoutError:
            log.warning("could not advertise within %.0f s; still browsing and dialing static peers", REGISTER_TIMEOUT_S)

    async def stop(self) -> None:
        """Say goodbye and close the sockets, within STOP_TIMEOUT_S."""
        aiozc, self._aiozc = self._aiozc, None
        if aiozc is None:
            return
        for task in self._tasks:
            task.cancel()
        if self._announce is not None:
            self._announce.cancel()
        try:
            await asyncio.wait_for(self._close(aiozc), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("mDNS did not shut down within %.0f s", STOP_TIMEOUT_S)
        self.advertising = False
        self._browser = self._announce = None
        self._found.clear()

    async def _close(self, aiozc: AsyncZeroconf) -> None:
        await asyncio.gather(*self._tasks, *([self._announce] if self._announce else []), return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
        await aiozc.async_close()  # unregisters, which sends the goodbyes

    # --- browser side -------------------------------------------------------------

    def _on_state_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        # Called by zeroconf on the event loop: must not block, must not raise.
        if state_change is ServiceStateChange.Removed:
            gone = self._found.pop(name, None)
            if gone is not None:
                log.info("advert of %s withdrawn", gone.node)
            return
        if self._aiozc is None:
            return
        if len(self._tasks) >= MAX_PENDING_LOOKUPS:
            log.debug("dropping advert %s: %d lookups already pending", name, len(self._tasks))
            return
        task = asyncio.get_running_loop().create_task(self._lookup(zeroconf, service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lookup(self, zeroconf: Zeroconf, service_type: str, name: str) -> None:
        try:
            info = AsyncServiceInfo(service_type, name)
            if not await info.async_request(zeroconf, LOOKUP_TIMEOUT_MS):
                log.debug("ignoring advert %s: its records did not arrive within %d ms", name, LOOKUP_TIMEOUT_MS)
                return
            self._consider(name, info)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bad record or a closing zeroconf; never out of the browser
            log.debug("ignoring advert %s: %s: %s", name, type(e).__name__, e)

    def _consider(self, name: str, info: ServiceInfo) -> None:
        me = self.advert
        try:
            advert = Advert.from_service_info(info)
        except ValueError as e:
            log.debug("ignoring advert %s: malformed: %s", name, e)
            return
        if advert.cluster != me.cluster:
            log.debug("ignoring advert %s: cluster %r, not %r", name, advert.cluster, me.cluster)
            return
        if advert.proto != me.proto:
            self._warn_once(
                ("proto", advert.node, advert.proto),
                "ignoring advert %s: node %s speaks protocol version %d, this node %d; "
                "run the same ringd version on every node",
                name, advert.node, advert.proto, me.proto,
            )  # fmt: skip
            return
        if advert.node == me.node:
            mine = advert.ring_port == me.ring_port and set(advert.addresses) <= set(me.addresses)
            if not mine:
                self._warn_once(
                    ("twin", advert.addresses, advert.ring_port),
                    "another daemon claims this node's id %r in cluster %r (at %s ring port %d); "
                    "node ids must be unique: set `name` in one of the configs",
                    me.node, me.cluster, ",".join(advert.addresses), advert.ring_port,
                )  # fmt: skip
            else:
                log.debug("ignoring advert %s: it is ours", name)
            return
        if self._found.get(name) == advert:
            return
        self._found[name] = advert
        log.info("found %s at %s ring port %d", advert.node, ",".join(advert.addresses), advert.ring_port)
        try:
            self.on_peer(advert)
        except Exception:
            log.exception("on_peer failed for the advert of %s", advert.node)

    def _warn_once(self, key: tuple, message: str, *args: object) -> None:
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, message, *args)


# --- python -m ringd.cluster.discovery ----------------------------------------------------


async def _main(args: argparse.Namespace) -> None:
    addresses = args.address or [ip for _, ip in local_addresses(args.prefer)]
    out = sys.stdout

    def emit(event: str, **fields: object) -> None:
        out.write(json.dumps({"event": event, **fields}) + "\n")
        out.flush()

    discovery = Discovery(
        node=args.node, cluster=args.cluster, ring_port=args.ring_port, http_port=args.http_port,
        addresses=addresses, on_peer=lambda advert: emit("peer", **asdict(advert)), interfaces=args.interface,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await discovery.start()
    try:
        emit("ready", advertising=discovery.advertising, **asdict(discovery.advert))
        try:
            await asyncio.wait_for(stop.wait(), args.seconds)
        except asyncio.TimeoutError:
            pass
    finally:
        await discovery.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ringd.cluster.discovery",
        description="Advertise a ringd node and print the adverts of its cluster as JSON lines.",
    )
    parser.add_argument("--node", default=socket.gethostname().split(".")[0])
    parser.add_argument("--cluster", default="ringd")
    parser.add_argument("--ring-port", type=int, default=DEFAULT_RING_PORT)
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT)
    parser.add_argument("--address", action="append", help="IPv4 address to advertise (default: this host's)")
    parser.add_argument("--prefer", action="append", default=[], help="interface name, glob or network to list first")
    parser.add_argument("--interface", action="append", help="speak mDNS only here (name, glob or IPv4; default: all)")
    parser.add_argument("--seconds", type=float, default=60.0, help="exit after this long (default 60)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        import uvloop  # what the daemon runs on
    except ImportError:
        asyncio.run(_main(args))
    else:
        uvloop.run(_main(args))


if __name__ == "__main__":
    main()
