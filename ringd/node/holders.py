"""Which peers hold the model whole and serve its files (``http/files.py``).

In the cluster, a linked peer's INFO says so (``files``, ``model``, ``http``). A node
that has no model yet (``model_from_peers``) must know before it joins: it dials the
ring ports it knows of (its static ``peers``, and what Bonjour finds) as a probe,
completes the handshake (both sides prove the cluster secret, so only members
answer, and it trusts what the INFO says as it trusts the ring), reads the INFO and
hangs up; a probe never joins the peer table (``links.py``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ringd.cluster.discovery import Advert, Discovery, DiscoveryError, dial_order
from ringd.cluster.memberinfo import MemberInfo
from ringd.models.peers import FetchError, Holder, PeerModel
from ringd.base.names import check_name, parse_hostport
from wire import stream as wire_stream

if TYPE_CHECKING:
    from ssl import SSLContext

    from ringd.node.config import Config
    from ringd.base.metrics import Metrics

log = logging.getLogger(__name__)

# What a probe says of itself in its INFO: a node's links hang up on it at once.
PROBE_INFO = {"probe": True}
# How long Bonjour is listened to for holders (their adverts arrive within a second or two).
BROWSE_S = 3.0
# How often a node with no model asks again for a peer that holds one.
PROBE_RETRY_S = 5.0


async def model_from_peers(cfg: "Config", secret: bytes, metrics: "Metrics", local_networks=(), ssl: "SSLContext | None" = None) -> PeerModel | None:
    """The model this node fetches from the peers that hold it (its config, tokenizer and headers
    fetched: its layers follow, plan by plan). None when no peer holds one and ``model`` names a
    Hub repo id: that is fetched from the Hub, as without model_from_peers. With no ``model``, a
    node waits for a holder, asking every PROBE_RETRY_S. With ``ring_encryption`` the bytes are
    asked for sealed; ``ssl``, a TLS context, makes the fetch speak https to holders."""
    models_dir = cfg.models_path
    while True:
        holders = await find_holders(cfg, secret, local_networks)
        if holders:
            log.info("fetching the model from peers: %s hold it", ", ".join(sorted(h.node for h in holders)))
            try:
                return await PeerModel.bootstrap(models_dir, holders, secret, cfg.name, metrics, sealed=cfg.ring_encryption, ssl=ssl)
            except FetchError as e:
                # A holder that went to sleep or away between the probe and the fetch, or one
                # that serves what it should not: said, and asked again, as when none is found
                # (a node that exited here would only be restarted by launchd to do the same).
                log.warning("model_from_peers: %s; asking again in %.0f s", e, PROBE_RETRY_S)
                await asyncio.sleep(PROBE_RETRY_S)
                continue
        if cfg.model is not None:
            log.info("model_from_peers: no peer holds a model; fetching %s as configured", cfg.model)
            return None
        kept = await asyncio.to_thread(_fetched_before, models_dir, secret, cfg.name, metrics, cfg.ring_encryption, ssl)
        if len(kept) == 1:
            # Fetched before: serve it (its layers are here; others are fetched when a holder is back).
            log.info("model_from_peers: no peer holds a model right now; starting with %s, fetched before", kept[0].root)
            return kept[0]
        where = ", ".join(cfg.peers) + (" and Bonjour" if cfg.discovery else "") if cfg.peers else ("Bonjour" if cfg.discovery else "nobody (no peers, discovery off)")
        log.warning("model_from_peers: no peer holding a model found yet (asked %s); asking again in %.0f s", where, PROBE_RETRY_S)
        await asyncio.sleep(PROBE_RETRY_S)


def _fetched_before(models_dir: Path, secret: bytes, node: str, metrics, sealed: bool, ssl: "SSLContext | None") -> list[PeerModel]:
    return [m for d in sorted(models_dir.glob("*")) if d.is_dir() and (m := PeerModel.open(d, secret, node, metrics, sealed=sealed, ssl=ssl)) is not None]


async def find_holders(cfg: "Config", secret: bytes, local_networks=()) -> list[Holder]:
    """The holders among the static peers and, with discovery on, the nodes Bonjour finds."""
    addrs = [parse_hostport(p) for p in cfg.peers]
    if cfg.discovery:
        addrs += await _browse(cfg, local_networks)
    return await probe(addrs, secret=secret, node=cfg.name, cluster=cfg.cluster, encrypt=cfg.ring_encryption)


async def _browse(cfg: "Config", local_networks) -> list[tuple[str, int]]:
    """The ring addresses of the cluster's nodes Bonjour finds within BROWSE_S, without advertising."""
    found: dict[str, Advert] = {}
    try:
        d = Discovery(
            node=cfg.name, cluster=cfg.cluster, ring_port=1, http_port=0, addresses=["127.0.0.1"],
            on_peer=lambda a: found.__setitem__(a.node, a), interfaces=cfg.mdns_interfaces, advertise=False,
        )  # fmt: skip
        await d.start()
    except (DiscoveryError, ValueError) as e:
        log.info("looking for holders without Bonjour: %s", e)
        return []
    try:
        await asyncio.sleep(BROWSE_S)
    finally:
        await d.stop()
    return [(dial_order(a.addresses, list(local_networks))[0], a.ring_port) for a in found.values()]


def holder_of(node: str, info: MemberInfo, model: str | None = None) -> Holder | None:
    """The peer as a holder if its INFO says it serves the files of ``model`` (None: any model)."""
    if not info.files or not info.model or model not in (None, info.model):
        return None
    return serving(node, info, info.model)


def serving(node: str, info: MemberInfo, model: str) -> Holder | None:
    """The peer as a holder of the files of ``model`` (its configured model's, or a leader's
    loaded on demand), if its name and HTTP address are sound."""
    try:
        check_name(node)
        parse_hostport(info.http)
    except ValueError:
        return None
    return Holder(node, info.http, model, https=info.https)


async def probe(addrs: Iterable[tuple[str, int]], *, secret: bytes, node: str, cluster: str, encrypt: bool) -> list[Holder]:
    """The holders among the ring ports at ``addrs``, each asked once, at once (a dial that fails
    or times out is no holder)."""

    async def ask(host: str, port: int) -> Holder | None:
        try:
            stream = await wire_stream.connect(host, port, secret=secret, node_id=node, cluster=cluster, info=PROBE_INFO, encrypt=encrypt)
        except (OSError, TimeoutError, wire_stream.HandshakeError) as e:
            log.debug("probe of %s:%d: %s", host, port, e)
            return None
        try:
            return holder_of(stream.peer_id, MemberInfo.parse(stream.peer_info))
        finally:
            stream.close()

    found = await asyncio.gather(*(ask(h, p) for h, p in dict.fromkeys(addrs)))
    return list({h.node: h for h in found if h is not None}.values())
