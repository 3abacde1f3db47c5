"""One ringd daemon: the parts of a node, built once and put together.

Wiring only, no policy. ``build(cfg)`` resolves everything a node is first (its
secret and TLS, its model, tokenizer and device, its listening sockets), then
makes the ``Node`` whole: every part exists once its constructor returns. The parts:

    cluster/members.py      links, election, pin, drains, heartbeats (who is here, who leads)
    node/stages.py          this node's stages, one per instance it holds layers of (stagehost.py each)
    node/pool.py            while leading: the instances, each a coordinator.py (reconciliation, plans, an engine)
    cluster/discovery.py    Bonjour adverts, and the addresses peers dial us at
    status.py               /health, /cluster/status, STATUS frames
    http/api.py             HTTP (through the narrow ``ApiNode`` this class provides)
    tasks.py                supervision of everything that runs as long as the node does

The node is what its parts tell and ask (``members.Owner``, ``stagehost.StageOwner``,
``http.node.ApiNode``). Frames from the links are routed by type to the part that owns
them; frames to this node itself never touch a socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
import ssl
import time
from pathlib import Path
from typing import Any, Callable

from ringd.cluster.discovery import Advert, Discovery, DiscoveryError, dial_order, local_networks, own_addresses
from ringd.cluster.election import Term
from ringd.cluster.memberinfo import MemberInfo
from ringd.cluster.members import Cluster, DrainError
from ringd.cluster.messages import MessageError, PoolModel, parse_loaded
from ringd.cluster.placement import ModelCost, NodeSpec, shortfall
from ringd.cluster.reconcile import Report
from ringd.ring.plan import Plan
from ringd.node.config import Config, ConfigError
from ringd.base.device import DeviceProfile, default_cache_dir, probe_speed, read_profile
from ringd.http.api import Api
from ringd.http.files import Holding
from ringd.leader.draft import Drafter
from ringd.leader.errors import EngineError
from ringd.base.listeners import bind
from ringd.base.metrics import Metrics
from ringd.models.catalogue import Catalogue
from ringd.models.checkpoint import ModelInfo, load_tokenizer, weights_complete
from ringd.models.errors import ModelError
from ringd.models.ollama.store import PREFIX as OLLAMA_PREFIX
from ringd.models.peers import FetchError, Holder, PeerModel
from ringd.models.source import model_info
from ringd.base.names import check_name, parse_hostport
from ringd.node.coordinator import Coordinator, NodeParts, ServedModel
from ringd.node.holders import holder_of, model_from_peers, serving
from ringd.node.pool import Pool
from ringd.stage.groupengine import GroupSettings
from ringd.node.stagehost import StageHost, StageSource
from ringd.node.stages import Stages
from ringd.stage.compute import ComputeThread
from ringd.node.status import Status
from ringd.base.tasks import Supervisor
from ringd.security.tls import TlsError, TlsSettings, client_context, server_context, trust_hint
from wire.frames import Frame, MsgType
from wire.stream import Lent

log = logging.getLogger(__name__)

# How often idle sessions are looked for; their timeout is SESSION_IDLE_TIMEOUT_S.
EXPIRE_INTERVAL_S = 30.0
# What clients of a node that stops hear (a 503: retry elsewhere).
STOPPING = "this node is stopping; retry the request (any other node of the cluster serves it)"


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a node is before any of its parts exists: read, fetched, probed and bound (``build``)."""

    cfg: Config
    secret: bytes
    tls: TlsSettings
    serving_tls: ssl.SSLContext | None  # the API's certificate, when it is https
    client_ssl: ssl.SSLContext | None  # whom this node trusts calling a peer's https API
    api_keys: frozenset[str]
    addresses: list[str]  # this host's addresses, the one peers dial first
    networks: list  # this host's IPv4 networks (which of a peer's addresses to dial)
    model: StageSource  # the configured model: its path, info, and the fetch from peers if any
    tokenizer: Any
    files: Holding | None  # the model this node serves to peers fetching theirs
    drafter: Drafter | None  # speculative decoding's draft model, for when this node leads
    profile: DeviceProfile
    budget: int | None  # bytes for weights + KV cache, from the profile and memory_budget_gb
    ring_sock: socket.socket  # listening
    http_sock: socket.socket  # listening


async def build(cfg: Config, ring_sock: socket.socket | None = None, http_sock: socket.socket | None = None) -> Node:
    """The node ``cfg`` describes, whole. ``ring_sock``, ``http_sock``: listening sockets handed
    down by a launcher (listeners.py), used instead of binding ring_port and http_port. A build
    that fails or is cancelled (a signal while a model is fetched) leaves no thread behind."""
    # Made first: a draft model and the device's speed are computed on the one, a fetch from
    # peers is counted in the other.
    compute, metrics = ComputeThread(), Metrics(cfg.name)
    try:
        return Node(await _resolve(cfg, compute, metrics, ring_sock, http_sock), compute, metrics)
    except BaseException:
        await compute.stop()
        raise


async def _resolve(cfg: Config, compute: ComputeThread, metrics: Metrics, ring_sock: socket.socket | None, http_sock: socket.socket | None) -> Resolved:
    if cfg.model is None and not cfg.model_from_peers:
        raise ModelError("model: no model configured; set model (or RINGD_MODEL, --model), or model_from_peers to fetch it from peers that hold it")
    secret = cfg.read_secret()
    tls = cfg.tls_settings(secret)
    addresses = own_addresses(cfg.advertise, cfg.host, cfg.prefer_interfaces)
    try:
        # Before any call to a peer's API (a model fetched from peers): whom this node trusts.
        # And a certificate that cannot be used stops the node now, not after a model's load.
        client_ssl = client_context(tls)
        serving_tls = server_context(tls, cfg.name, socket.gethostname(), [*addresses, cfg.http_host]) if tls.on else None
    except TlsError as e:
        raise ConfigError(str(e)) from None
    api_keys = cfg.read_api_keys() if cfg.api_keys_file else frozenset()
    networks = local_networks()
    loop = asyncio.get_running_loop()
    model, peer_model = cfg.model, None
    if cfg.model_from_peers and not _on_disk(model):
        peer_model = await model_from_peers(cfg, secret, metrics, local_networks=networks, ssl=client_ssl)
        if peer_model is not None:
            model = str(peer_model.path)
    info = await loop.run_in_executor(None, model_info, model)
    files = None
    if peer_model is None and await loop.run_in_executor(None, weights_complete, info.path):
        # A model of its own, whole: served to peers that fetch theirs (sealed only, on a network
        # ring_encryption calls untrusted; not by a node that fetched its stage's files only).
        files = Holding(info.path, info.fingerprint, info.name, default_cache_dir(), sealed=cfg.ring_encryption)
    tokenizer = await loop.run_in_executor(None, load_tokenizer, info)
    profile = await loop.run_in_executor(None, read_profile, cfg.capabilities)
    drafter = await Drafter.load(cfg.draft_model, compute, info) if cfg.draft_model is not None else None
    profile = dataclasses.replace(profile, speed=await compute.run(probe_speed, default_cache_dir()))
    return Resolved(
        cfg, secret, tls, serving_tls, client_ssl, api_keys, addresses, networks, StageSource(model, info, peer_model),
        tokenizer, files, drafter, profile, profile.budget(cfg.memory_budget_gb),
        ring_sock if ring_sock is not None else _bind("ring_port", cfg.host, cfg.ring_port),
        http_sock if http_sock is not None else _bind("http_port", cfg.http_host, cfg.http_port),
    )  # fmt: skip


class Node:
    def __init__(self, r: Resolved, compute: ComputeThread, metrics: Metrics):
        cfg = self.cfg = r.cfg
        self.name = cfg.name
        self.started = int(time.time())
        self._started = time.monotonic()
        self.r = r
        self.supervisor = Supervisor(log)
        self.compute = compute
        self.metrics = metrics
        self._fetched: set[str] = set()  # fingerprints of models loaded on demand fetched from the leader (model_from_peers)
        # What the API reads of the node (http/node.ApiNode).
        self.info, self.tokenizer = r.model.info, r.tokenizer
        self.model_id = cfg.model_id or r.model.info.name
        self.secret, self.api_keys, self.client_ssl, self.files = r.secret, r.api_keys, r.client_ssl, r.files
        self.chat_template_kwargs = cfg.chat_template_kwargs
        self.fetch_image_urls = cfg.fetch_image_urls
        self.failover_wait_s = cfg.failover_wait_s
        self.budget = r.budget
        # The models on this machine that the model list shows (scanned at start, then as asked).
        self.catalogue = Catalogue(cfg.models_path)
        host = r.addresses[0]
        self.addr = f"{host}:{r.ring_sock.getsockname()[1]}"
        self.http_addr = f"{host if cfg.http_host in ('0.0.0.0', '::') else cfg.http_host}:{r.http_sock.getsockname()[1]}"
        # What peers learn of this node once it has proved the secret. Whether the API is https:
        # a follower forwards to its leader with the scheme the leader serves.
        own = MemberInfo(
            addr=self.addr, http=self.http_addr, https=r.tls.on, model=self.info.fingerprint, budget=self.budget,
            priority=cfg.priority, api_only=cfg.api_only, files=r.files is not None, profile=r.profile,
        )  # fmt: skip
        self.api = Api(self)
        settings = GroupSettings(cfg.tensor_engine, cfg.rdma_devices)
        self.stages = Stages(lambda instance: StageHost(self.name, instance, self, compute, metrics, settings))
        self.stage = self.stages.default  # the configured model's stage
        self.cluster = Cluster(cfg.cluster_settings(), r.secret, own, self.supervisor, self)
        self.status = Status(
            self.name, self.cluster, self.stage, self._facts, lambda: self.coordinator, self._kv_capacity,
            self.budget, self.supervisor, metrics,
        )  # fmt: skip
        metrics.read_gauges_from(self.status.gauges)
        self.discovery = self._discovery() if cfg.discovery else None  # None: off, or nothing to advertise
        self.pool: Pool | None = None  # while leading: the instances it serves
        self.stopping = False

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        cfg, r = self.cfg, self.r
        trust = f"trust the cluster CA: {trust_hint(cfg.cluster)}" if r.tls.mode == "auto" else "trust the CA that issued the certificate in its tls_cert"
        await self.api.start(cfg.http_host, cfg.http_port, r.http_sock, r.serving_tls, self.supervisor, trust)
        await self.cluster.links.listen(cfg.host, cfg.ring_port, r.ring_sock)
        for peer in cfg.peers:
            self.cluster.links.dial(*parse_hostport(peer), persistent=True)
        if self.discovery is not None:
            self.supervisor.once("discovery", self._discover(self.discovery))
        # The model list's first scan, now rather than on the first client's request.
        self.supervisor.once("model list", self.catalogue.listing())
        self.supervisor.forever("session expiry", self._expire_loop)
        log.info(
            "ringd node %s up: ring %s, http %s://%s, model %s (%d layers), priority %d%s",
            self.name, self.addr, r.tls.scheme, self.http_addr, self.model_id, self.info.num_layers, cfg.priority,
            ", ring encryption on" if cfg.ring_encryption else "",
        )  # fmt: skip
        self.cluster.view_changed()  # a node alone elects itself

    async def stop(self) -> None:
        """Leave the cluster, in this order: the peers hear LEAVE (and plan without this node at
        once); HTTP takes no more requests and ends what it forwards; the engine ends what it
        serves; every task stops (a load under way is given up); the compute thread finishes
        its step and MLX goes idle; the links close. Each step is bounded: it exits within seconds."""
        self.stopping = True
        self.stages.stop()
        self.cluster.leave()
        self.api.stop_serving(STOPPING)
        if self.pool is not None:
            # A 503 "service unavailable": a follower forwarding the stream carries it over to
            # the next leader; a client of this node's own gets the error event and [DONE].
            self.pool.close(STOPPING)
        await self.api.stop()
        await self.supervisor.stop()
        if self.discovery is not None:
            await self.discovery.stop()  # goodbyes, so peers' browsers forget us now
        await self.compute.stop()
        await self.cluster.links.close()

    # --- discovery --------------------------------------------------------------------

    def _discovery(self) -> Discovery | None:
        """This node's Bonjour advert and browser, not yet started; None if it cannot advertise."""
        r = self.r
        ipv4 = [a for a in r.addresses if ":" not in a]
        if not ipv4:
            log.warning("discovery off: no IPv4 address to advertise (%s); dialing static peers only", r.addresses)
            return None
        try:
            return Discovery(
                node=self.name, cluster=self.cfg.cluster, ring_port=r.ring_sock.getsockname()[1],
                http_port=r.http_sock.getsockname()[1], addresses=ipv4, on_peer=self._on_advert,
                interfaces=self.cfg.mdns_interfaces,
            )  # fmt: skip
        except ValueError as e:
            log.warning("discovery off: %s; dialing static peers only", e)
            return None

    async def _discover(self, discovery: Discovery) -> None:
        try:
            await discovery.start()
        except (DiscoveryError, ValueError) as e:
            log.warning("discovery off: %s; dialing static peers only", e)
            await discovery.stop()

    def _on_advert(self, advert: Advert) -> None:
        if advert.node in self.cluster.peers:
            return  # linked already (a static peer, gossip, or it dialed us)
        host = dial_order(advert.addresses, self.r.networks)[0]
        log.info("dialing %s at %s:%d (found by Bonjour)", advert.node, host, advert.ring_port)
        self.cluster.links.dial(host, advert.ring_port)

    # --- routing ----------------------------------------------------------------------

    def send(self, node: str, frame: Frame) -> None:
        self.cluster.send(node, frame)

    def send_now(self, node: str, frame: Frame) -> bool:
        return self.cluster.send_now(node, frame)

    def grouped(self) -> bool:
        return any(host.grouped for host in self.stages.all())

    def lend(self, node: str, take: Callable[[Frame], bool], returned: Callable[[], None]) -> Lent | None:
        """The reading of ``node``'s link, lent to the compute thread (``StageOwner.lend``)."""
        lent = self.cluster.lend(node, take, returned, self.compute.nudge)
        if lent is not None:
            self.compute.watch(lent)
        return lent

    def on_frame(self, peer: str, frame: Frame) -> None:
        """A frame from ``peer`` (heartbeats and election notes are the cluster's own)."""
        t = frame.type
        if t in (MsgType.FORWARD, MsgType.RELEASE, MsgType.MEDIA):
            self.stages.route(frame).on_frame(peer, frame)
        elif t == MsgType.REDUCE:
            self.stages.route(frame).on_reduce(peer, frame)
        elif t in (MsgType.TOKEN, MsgType.ERROR):
            if self.pool is not None:
                self.pool.on_frame(peer, frame)
        elif t == MsgType.PLAN:
            taken = self.stages.take(peer, frame.descriptor, self.cluster.leader)
            if taken is not None:
                host, plan = taken
                self.supervisor.once(f"load plan {plan.term}", host.load(plan))
        elif t == MsgType.UNLOAD:
            self.stages.unload(peer, frame.descriptor, self.cluster.leader)
        elif t == MsgType.LOADED:
            try:
                report = parse_loaded(frame.descriptor)
            except MessageError as e:
                log.warning("ignoring a malformed LOADED from %s: %s", peer, e)
                return
            if peer != self.name:
                self.cluster.take_report(peer, report)
            self.on_change()
        elif t in (MsgType.STATUS, MsgType.STATUS_REPLY):
            self.status.on_frame(peer, frame)
        else:
            log.debug("ignoring %s frame from %s", t.name, peer)

    # --- what the cluster tells and asks (members.Owner) ---------------------------------

    def on_leadership(self, leading: bool) -> None:
        if leading:
            parts = NodeParts(self.cfg, self.cluster, self.stages, self.supervisor, self.metrics, self._started)
            configured = ServedModel("", "", self.info, self.tokenizer, self.r.drafter)
            self.pool = Pool(
                parts, configured, self.model_id, self.catalogue, planned_before=self.stage.plan is not None, restore=self.cluster.pool or (),
            )  # fmt: skip
        elif self.pool is not None:
            self.pool.close(f"leadership moved to {self.cluster.leader or 'another node'}; retry")
            self.pool = None

    def on_change(self) -> None:
        self.stages.check_links({p: peer.number for p, peer in self.cluster.peers.items()})
        if self.cluster.leader is not None:
            self.stages.leader_is(self.cluster.leader, {i for m in self.kept_models() for i in m.instances})
        if self.pool is not None:
            self.pool.changed()

    def reports(self) -> tuple[Report, tuple[Report, ...]]:
        return self.stage.report, self.stages.reports()

    def serving(self) -> tuple[Term | None, str]:
        return self.coordinator.serving() if self.coordinator is not None else (None, "not leading")

    def kept_models(self) -> tuple[PoolModel, ...]:
        """The models the leader keeps: this node's own while it leads, else as the leader's heartbeats say."""
        return self.pool.manifest() if self.pool is not None else self.cluster.pool or ()

    def sent(self, seconds: float) -> None:
        self.metrics.link_send.observe(seconds)

    # --- what a stage host asks (stagehost.StageOwner) ------------------------------------

    def reported(self) -> None:
        self.on_change()

    def departed(self, node: str) -> bool:
        return node in self.cluster.left

    def dial(self, host: str, port: int) -> None:
        self.cluster.links.dial(host, port)

    def holders(self, fingerprint: str) -> list[Holder]:
        """The linked peers that serve the files of the model ``fingerprint``: those whose configured
        model it is, and the leader for a model it loaded on demand."""
        found = [h for p, peer in self.cluster.peers.items() if (h := holder_of(p, peer.info, fingerprint)) is not None]
        leader = self.cluster.peers.get(self.cluster.leader or "")
        if fingerprint in self._fetched and leader is not None and all(h.node != self.cluster.leader for h in found):
            found += [h for h in [serving(self.cluster.leader, leader.info, fingerprint)] if h is not None]
        return found

    def holding(self, fingerprint: str) -> Holding | None:
        """While leading, the files of a model it loaded on demand (from its own model list, whole),
        served to the nodes that fetch their layers of it."""
        pool = self.pool
        inst = next((i for i in pool.instances.values() if i.name and i.info.fingerprint == fingerprint), None) if pool else None
        if inst is None:
            return None
        info = inst.info
        return Holding(info.path, fingerprint, info.name, default_cache_dir(), sealed=self.cfg.ring_encryption)

    async def resolve(self, plan: Plan) -> StageSource:
        """The model the leader's plan names, as this node's model list holds it ("": this node's
        configured model, of which the leader keeps replicas); with ``model_from_peers``, one its
        list lacks is fetched from the leader, which serves the files of what it loaded: its
        config, tokenizer and headers now, the layers of each plan before they load."""
        name = plan.source
        if not name:
            return self.r.model
        entry = await self.catalogue.lookup(name)
        if entry is not None and entry.facts.info is not None:
            info = await asyncio.get_running_loop().run_in_executor(None, model_info, entry.ref)
            return StageSource(entry.ref, info)
        why = entry.facts.error if entry is not None else "no model by that name in its model list (models_dir, the Ollama store, the Hugging Face cache)"
        if not self.cfg.model_from_peers or plan.leader == self.name:
            raise ModelError(
                f"{self.name} cannot load model {name}: {why}; every node that holds its layers needs its files "
                "(or model_from_peers, to fetch them from the leader)"
            )  # fmt: skip
        self._fetched.add(plan.model)
        holders = self.holders(plan.model)
        if not holders:
            raise ModelError(f"{self.name} cannot load model {name}: {why}, and its leader {plan.leader} is not linked to fetch it from")
        log.info("%s is not in this node's model list: fetching it from %s", name, ", ".join(h.node for h in holders))
        try:
            fetched = await PeerModel.bootstrap(
                self.cfg.models_path, holders, self.secret, self.name, self.metrics, fingerprint=plan.model, sealed=self.cfg.ring_encryption,
                ssl=self.client_ssl,
            )  # fmt: skip
        except FetchError as e:
            raise ModelError(f"{self.name} cannot fetch model {name} from {plan.leader}: {e}") from None
        info = await asyncio.get_running_loop().run_in_executor(None, model_info, str(fetched.path))
        return StageSource(str(fetched.path), info, fetched)

    def tokenizer_of(self, info: ModelInfo) -> Any:
        return self.tokenizer if info is self.info else load_tokenizer(info)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            self.stages.expire_idle()

    # --- what the API and status see (api.ApiNode) --------------------------------------

    @property
    def coordinator(self) -> Coordinator | None:
        """The configured model's coordinator, while this node leads."""
        return self.pool.default.coordinator if self.pool is not None else None

    @property
    def leading(self) -> bool:
        return self.pool is not None

    async def served(self, name: str | None, keep_alive: float | None | bool = False):
        pool = self.pool
        if pool is None:
            raise EngineError("this node does not lead; retry in a moment", 503)
        return await pool.served(name, keep_alive)  # the configured model's too: its replicas share its requests

    async def load(self, name: str, replicas: int = 1, keep_alive: float | None | bool = False):
        if self.pool is None:
            raise EngineError("this node does not lead; retry in a moment", 503)
        return await self.pool.load(name, replicas, keep_alive)  # the configured model's replicas too

    def find(self, instance: str):
        return self.pool.instances.get(instance) if self.pool is not None else None

    def loaded(self, name: str):
        return self.pool.find(name) if self.pool is not None else None

    def instances(self) -> list[dict]:
        return self.pool.status() if self.pool is not None else []

    def unload(self, name: str) -> list[str]:
        return self.pool.unload_model(name, "asked to (keep_alive 0, or ringctl unload)") if self.pool is not None else []

    def members(self) -> set[str]:
        return set(self.cluster.election.members)

    def fit_rule(self) -> Callable[[ModelInfo], str | None]:
        """placement.shortfall over the members as they are now (each one's budget, api_only or not)."""
        nodes = [NodeSpec(node, "", i.budget, api_only=i.api_only) for node, i in sorted(self.cluster.member_infos().items())]
        cfg = self.cfg
        return lambda info: shortfall(nodes, ModelCost.of(info, cfg.kv_reserve_tokens, cfg.kv_bits, cfg.kv_group_size))

    def readiness(self) -> tuple[bool, str]:
        if self.stopping:
            return False, STOPPING
        return self.status.readiness()

    def local_status(self) -> dict:
        return self.status.local()

    async def cluster_status(self) -> dict:
        return await self.status.cluster_status()

    def leader_http(self) -> str | None:
        leader = self.cluster.leader
        if leader is None:
            return None
        info = self.cluster.info_of(leader)
        return f"{'https' if info.https else 'http'}://{info.http}" if info.http else None

    async def leader_changed(self) -> None:
        """Returns when the leader changes next."""
        await self.cluster.leader_changed()

    def set_pin(self, node: str | None) -> dict:
        """Pin ``node`` (None: unpin); the new pin, as [epoch, node], and who leads now."""
        self.cluster.set_pin(node)
        return {"pin": self.cluster.election.pin.to_wire(), "leader": self.cluster.leader}

    def drain(self, node: str, undo: bool) -> None:
        check_name(node)
        try:
            self.cluster.drain(node, undo)
        except DrainError as e:
            raise ValueError(str(e)) from None

    @property
    def leader(self) -> str | None:
        return self.cluster.leader

    @property
    def drained(self) -> set[str]:
        return self.cluster.drained

    def _facts(self) -> dict:
        return {
            "addr": self.addr,
            "http": self.http_addr,
            "model": self.model_id,
            "speed": round(self.r.profile.speed, 2) if self.r.profile.speed else None,
            "device": self.r.profile.to_wire(),
            "discovery": {
                "enabled": self.cfg.discovery,
                "advertising": bool(self.discovery and self.discovery.advertising),
                "found": sorted(self.discovery.peers) if self.discovery else [],
            },
            "ring_encryption": self.cfg.ring_encryption,
            "tls": self.r.tls.mode,
            # The leader's instances (the models it serves now), for ringctl ps and the dashboard.
            "instances": self.instances(),
            # This node's stages of those instances (their layers, sessions, load progress).
            "instance_stages": self.stages.status(),
            # The models the leader keeps loaded (its own, or as its heartbeats say): what a next leader loads again.
            "kept_models": [m.to_wire() for m in self.kept_models()],
        }

    def _kv_capacity(self, start: int, end: int) -> int | None:
        return None if self.budget is None else self.budget - self.info.weights.stage(start, end)


def _on_disk(model: str | None) -> bool:
    """Whether ``model`` names a model on this machine (a directory, a GGUF file, Ollama's store),
    not a Hub repo id still to fetch, or nothing."""
    if model is None:
        return False
    return model.startswith(OLLAMA_PREFIX) or Path(model).expanduser().exists()


def _bind(key: str, host: str, port: int) -> socket.socket:
    """A socket listening on host:port; a port in use is an error that names the key and the port."""
    try:
        sock = bind(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{key}: port {port} on {host} is in use by another process (another ringd?); "
                f"stop it or choose another port (--{key.replace('_', '-')})"
            ) from None
        raise
    sock.set_inheritable(False)  # this node's own: no process it starts holds it
    sock.setblocking(False)
    return sock
