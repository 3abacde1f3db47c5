"""One ringd daemon: the parts of a node, put together.

Wiring only, no policy. The parts:

    cluster/members.py      links, election, pin, drains, heartbeats (who is here, who leads)
    node/stages.py          this node's stages, one per instance it holds layers of (stagehost.py each)
    node/pool.py            while leading: the instances, each a coordinator.py (reconciliation, plans, an engine)
    cluster/discovery.py    Bonjour adverts, and the addresses peers dial us at
    status.py               /health, /cluster/status, STATUS frames
    http/api.py             HTTP (through the narrow ``ApiNode`` this class provides)
    tasks.py                supervision of everything that runs as long as the node does

Frames from the links are routed by type to the part that owns them; frames
to this node itself never touch a socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
import time
from pathlib import Path
from typing import Callable

from ringd.node.coordinator import Coordinator
from ringd.node.pool import Pool
from ringd.node.stages import Stages
from ringd.cluster.discovery import Advert, Discovery, DiscoveryError, dial_order, local_networks, own_addresses
from ringd.node.holders import holder_of, model_from_peers
from ringd.cluster.members import Cluster, DrainError
from ringd.cluster.messages import MessageError, parse_loaded
from ringd.node.stagehost import StageHost
from ringd.config import Config, ConfigError
from ringd.device import DeviceProfile, default_cache_dir, probe_speed, read_profile
from ringd.http.api import Api
from ringd.http.files import Holding
from ringd.leader.draft import Drafter
from ringd.leader.engine import Engine
from ringd.metrics import Gauges, Metrics
from ringd.cluster.placement import ModelCost, NodeSpec, shortfall
from ringd.models.catalogue import Catalogue
from ringd.models.checkpoint import ModelInfo, load_tokenizer, weights_complete
from ringd.leader.errors import EngineError
from ringd.models.source import model_info
from ringd.models.errors import ModelError
from ringd.models.ollama import PREFIX as OLLAMA_PREFIX
from ringd.models.peers import Holder, PeerModel
from ringd.names import check_name, parse_hostport
from ringd.stage.compute import ComputeThread
from ringd.status import Status
from ringd.tasks import Supervisor
from ringd.tls import TlsError, TlsSettings, client_context, server_context, trust_hint
from wire.frames import Frame, MsgType

log = logging.getLogger(__name__)

# How often idle sessions are looked for; their timeout is SESSION_IDLE_TIMEOUT_S.
EXPIRE_INTERVAL_S = 30.0
# What clients of a node that stops hear (a 503: retry elsewhere).
STOPPING = "this node is stopping; retry the request (any other node of the cluster serves it)"


class Daemon:
    def __init__(self, cfg: Config, ring_sock: socket.socket | None = None, http_sock: socket.socket | None = None):
        """``ring_sock``, ``http_sock``: listening sockets handed down by a launcher (listeners.py),
        used instead of binding ring_port and http_port."""
        self.cfg = cfg
        self._ring_sock, self._http_sock = ring_sock, http_sock
        self.name = cfg.name
        self.started = int(time.time())
        self.supervisor = Supervisor(log)
        self.compute = ComputeThread()
        self.metrics = Metrics(self.name, lambda: self.status.gauges() if self.status else Gauges())
        self.chat_template_kwargs = cfg.chat_template_kwargs
        self.api = Api(self)
        self.info: ModelInfo | None = None
        self.tokenizer = None
        self.drafter: Drafter | None = None  # speculative decoding's draft model, for when this node leads
        self.model_id = cfg.model_id or ""
        self.failover_wait_s = cfg.failover_wait_s
        self.secret = b""
        self.api_keys: frozenset[str] = frozenset()
        self.cluster: Cluster | None = None
        self.stage: StageHost | None = None  # the configured model's stage (``stages.default``)
        self.stages: Stages | None = None
        self.pool: Pool | None = None  # while leading: the instances it serves
        self.status: Status | None = None
        self.discovery: Discovery | None = None
        self.profile: DeviceProfile | None = None
        self.budget: int | None = None  # bytes for weights + KV cache, from the profile and memory_budget_gb
        self.peer_model: PeerModel | None = None  # the model, fetched from peers (model_from_peers)
        self.files: Holding | None = None  # the model this node serves to peers fetching theirs
        # The models on this machine that the model list shows (scanned at start, then as asked).
        self.catalogue = Catalogue(cfg.models_path)
        self.addr = ""
        self.http_addr = ""
        self.tls: TlsSettings | None = None
        self.client_ssl = None  # whom this node trusts calling a peer's https API: set at start
        self._own: dict = {}  # what peers learn of this node once it has proved the secret
        self._networks = []  # this host's IPv4 networks, read at start
        self._started = time.monotonic()
        self.stopping = False

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.model is None and not cfg.model_from_peers:
            raise ModelError("model: no model configured; set model (or RINGD_MODEL, --model), or model_from_peers to fetch it from peers that hold it")
        self.secret = cfg.read_secret()
        self.tls = cfg.tls_settings(self.secret)
        addresses = own_addresses(cfg.advertise, cfg.host, cfg.prefer_interfaces)
        try:
            # Before any call to a peer's API (a model fetched from peers): whom this node trusts.
            # And a certificate that cannot be used stops the node now, not after a model's load.
            self.client_ssl = client_context(self.tls)
            serving_tls = server_context(self.tls, self.name, socket.gethostname(), [*addresses, cfg.http_host]) if self.tls.on else None
        except TlsError as e:
            raise ConfigError(str(e)) from None
        self.api_keys = cfg.read_api_keys() if cfg.api_keys_file else frozenset()
        self._networks = local_networks()
        loop = asyncio.get_running_loop()
        model = cfg.model
        if cfg.model_from_peers and not _on_disk(model):
            self.peer_model = await model_from_peers(cfg, self.secret, self.metrics, local_networks=self._networks, ssl=self.client_ssl)
            if self.peer_model is not None:
                model = str(self.peer_model.path)
        self.info = await loop.run_in_executor(None, model_info, model)
        if self.peer_model is None and await loop.run_in_executor(None, weights_complete, self.info.path):
            # A model of its own, whole: served to peers that fetch theirs (sealed only, on a network
            # ring_encryption calls untrusted; not by a node that fetched its stage's files only).
            self.files = Holding(self.info.path, self.info.fingerprint, self.info.name, default_cache_dir(), sealed=cfg.ring_encryption)
        self.tokenizer = await loop.run_in_executor(None, load_tokenizer, self.info)
        self.model_id = cfg.model_id or self.info.name
        profile = await loop.run_in_executor(None, read_profile, cfg.capabilities)
        if cfg.draft_model is not None:
            self.drafter = await Drafter.load(cfg.draft_model, self.compute, self.info)
        speed = await self.compute.run(probe_speed, default_cache_dir())
        self.profile = dataclasses.replace(profile, speed=speed)
        self.budget = self.profile.budget(cfg.memory_budget_gb)

        trust = f"trust the cluster CA: {trust_hint(cfg.cluster)}" if self.tls.mode == "auto" else "trust the CA that issued the certificate in its tls_cert"
        http_port = await _bind(
            "http_port", cfg.http_host, cfg.http_port,
            self.api.start(cfg.http_host, cfg.http_port, self._http_sock, serving_tls, self.supervisor, trust),
        )  # fmt: skip
        own: dict = {
            "model": self.info.fingerprint, "budget": self.budget, "priority": cfg.priority,
            "profile": self.profile.to_wire(), "api_only": cfg.api_only, "files": self.files is not None,
            # Whether the API is https: a follower forwards to its leader with the scheme the leader serves.
            "https": self.tls.on,
        }  # fmt: skip
        self._own = own
        self.stage = StageHost(
            self.name, model, self.info, self.compute, self._send, self._on_change, self.metrics,
            tokenizer_source=lambda: self.tokenizer, departed=lambda node: node in self.cluster.left,
            peer_model=self.peer_model, holders=self._holders,
        )
        self.stages = Stages(self.stage, self._instance_stage)
        self.cluster = Cluster(
            node=self.name, cluster=cfg.cluster, priority=cfg.priority, secret=self.secret, info=own,
            state_file=Path(cfg.state_dir).expanduser() / f"{cfg.cluster}-{self.name}.json",
            heartbeat_interval_s=cfg.heartbeat_interval_s, dead_after_s=cfg.dead_after_s, encrypt=cfg.ring_encryption,
            supervisor=self.supervisor, on_frame=self._route, on_leadership=self._on_leadership,
            on_change=self._on_change, report=lambda: self.stage.report, serving=self._serving,
            sent=self.metrics.link_send.observe, instances=self.stages.reports,
        )  # fmt: skip
        self.stage.dial = self.cluster.links.dial
        self.status = Status(
            self.name, self.cluster, self.stage, self._facts, lambda: self.coordinator, self._kv_capacity,
            self.budget, self.supervisor, self.metrics,
        )  # fmt: skip
        ring_port = await _bind("ring_port", cfg.host, cfg.ring_port, self.cluster.links.listen(cfg.host, cfg.ring_port, self._ring_sock))
        self.addr = f"{addresses[0]}:{ring_port}"
        self.http_addr = f"{addresses[0] if cfg.http_host in ('0.0.0.0', '::') else cfg.http_host}:{http_port}"
        # Peers learn these after the handshake; filled in now that the ports are bound.
        own.update(addr=self.addr, http=self.http_addr)
        for peer in cfg.peers:
            self.cluster.links.dial(*parse_hostport(peer), persistent=True)
        if cfg.discovery:
            self.supervisor.once("discovery", self._discover(addresses, ring_port, http_port))
        # The model list's first scan, now rather than on the first client's request.
        self.supervisor.once("model list", self._scan_models())
        self.supervisor.forever("session expiry", self._expire_loop)
        log.info(
            "ringd node %s up: ring %s, http %s://%s, model %s (%d layers), priority %d%s",
            self.name, self.addr, self.tls.scheme, self.http_addr, self.model_id, self.info.num_layers, cfg.priority,
            ", ring encryption on" if cfg.ring_encryption else "",
        )  # fmt: skip
        self.cluster.view_changed()  # a node alone elects itself

    async def stop(self) -> None:
        """Leave the cluster, in this order: the peers hear LEAVE (and plan without this node at
        once); HTTP takes no more requests and ends what it forwards; the engine ends what it
        serves; every task stops (a load under way is given up); the compute thread finishes
        its step and MLX goes idle; the links close. Each step is bounded: it exits within seconds."""
        self.stopping = True
        if self.stages is not None:
            self.stages.stop()
        if self.cluster is not None:
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
        if self.cluster is not None:
            await self.cluster.links.close()

    # --- discovery --------------------------------------------------------------------

    async def _discover(self, addresses: list[str], ring_port: int, http_port: int) -> None:
        ipv4 = [a for a in addresses if ":" not in a]
        if not ipv4:
            log.warning("discovery off: no IPv4 address to advertise (%s); dialing static peers only", addresses)
            return
        try:
            self.discovery = Discovery(
                node=self.name, cluster=self.cfg.cluster, ring_port=ring_port, http_port=http_port,
                addresses=ipv4, on_peer=self._on_advert, interfaces=self.cfg.mdns_interfaces,
            )  # fmt: skip
            await self.discovery.start()
        except (DiscoveryError, ValueError) as e:
            log.warning("discovery off: %s; dialing static peers only", e)
            self.discovery = None

    def _on_advert(self, advert: Advert) -> None:
        if advert.node in self.cluster.peers:
            return  # linked already (a static peer, gossip, or it dialed us)
        host = dial_order(advert.addresses, self._networks)[0]
        log.info("dialing %s at %s:%d (found by Bonjour)", advert.node, host, advert.ring_port)
        self.cluster.links.dial(host, advert.ring_port)

    # --- routing ----------------------------------------------------------------------

    def _send(self, node: str, frame: Frame) -> None:
        self.cluster.send(node, frame)

    def _route(self, peer: str, frame: Frame) -> None:
        """A frame from ``peer`` (heartbeats and election notes are the cluster's own)."""
        t = frame.type
        if t in (MsgType.FORWARD, MsgType.RELEASE):
            self.stages.route(frame).on_frame(peer, frame)
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
            self._on_change()
        elif t in (MsgType.STATUS, MsgType.STATUS_REPLY):
            self.status.on_frame(peer, frame)
        else:
            log.debug("ignoring %s frame from %s", t.name, peer)

    # --- leadership -------------------------------------------------------------------

    def _on_leadership(self, leading: bool) -> None:
        if leading:
            planned_before = self.stage.plan is not None
            self.pool = Pool(
                self.cfg, self.model_id,
                lambda pool: self._coordinator(pool, "", "", self.info, self.tokenizer, planned_before, self.drafter),
                lambda pool, name, model, info, tokenizer: self._coordinator(pool, name, model, info, tokenizer, True, None),
                self.catalogue, self.supervisor, self._budgets,
            )  # fmt: skip
        elif self.pool is not None:
            self.pool.close(f"leadership moved to {self.cluster.leader or 'another node'}; retry")
            self.pool = None

    def _coordinator(self, pool: Pool, instance: str, model: str, info: ModelInfo, tokenizer, planned_before: bool, drafter) -> Coordinator:
        return Coordinator(
            self.cfg, info, tokenizer, self.cluster, self.stages.named(instance), self.supervisor, self._own,
            self.budget, self._started, self.metrics, planned_before=planned_before, drafter=drafter,
            instance=instance, source=model, host=lambda: self.stages.named(instance),
            room=lambda node: pool.room(instance, node), kv_room=lambda node: pool.kv_room(instance, node),
            nodes=lambda: pool.nodes_for(instance),
        )  # fmt: skip

    def _instance_stage(self, instance: str) -> StageHost:
        """A stage for another of the leader's instances: its model found by name in this node's list."""
        host = StageHost(
            self.name, None, None, self.compute, self._send, self._on_change, self.metrics,
            tokenizer_source=lambda: load_tokenizer(host.info), departed=lambda node: node in self.cluster.left,
            instance=instance, resolve=self._resolve,
        )  # fmt: skip
        return host

    async def _resolve(self, name: str) -> tuple[str, ModelInfo]:
        """The model the leader's plan names, as this node's model list holds it: its path and info
        ("": this node's configured model, of which the leader keeps replicas)."""
        if not name:
            return self.stage.model, self.info
        entry = await self.catalogue.lookup(name)
        if entry is None or entry.facts.info is None:
            why = entry.facts.error if entry is not None else "no model by that name in its model list (models_dir, the Ollama store, the Hugging Face cache)"
            raise ModelError(f"{self.name} cannot load model {name}: {why}; every node that holds its layers needs its files")
        info = await asyncio.get_running_loop().run_in_executor(None, model_info, entry.ref)
        return entry.ref, info

    def _budgets(self) -> dict[str, tuple[int | None, bool]]:
        """Each member's memory budget and whether it is api_only, as it said at its handshake."""
        out = {}
        for node in self.members():
            info = self._own if node == self.name else self.cluster.info_of(node)
            budget = self.budget if node == self.name else info.get("budget")
            budget = budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None
            out[node] = (budget, info.get("api_only") is True)
        return out

    def _on_change(self) -> None:
        if self.stages is not None and self.cluster is not None:
            self.stages.check_links({p: peer.number for p, peer in self.cluster.peers.items()})
            if self.cluster.leader is not None:
                self.stages.leader_is(self.cluster.leader)
        if self.pool is not None:
            self.pool.changed()

    def _holders(self, model: str) -> list[Holder]:
        """The linked peers that serve the files of ``model``."""
        found = (holder_of(p, peer.info, model) for p, peer in self.cluster.peers.items())
        return [h for h in found if h is not None]

    def _serving(self):
        return self.coordinator.serving() if self.coordinator is not None else (None, "not leading")

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
    def engine(self) -> Engine | None:
        return self.coordinator.engine if self.coordinator is not None else None

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
        return set(self.cluster.election.members) if self.cluster else {self.name}

    async def _scan_models(self) -> None:
        await self.catalogue.listing()

    def fit_rule(self) -> Callable[[ModelInfo], str | None]:
        """placement.shortfall over the members as they are now (each one's budget, api_only or not)."""
        nodes = [NodeSpec(node, "", budget, api_only=api_only) for node, (budget, api_only) in sorted(self._budgets().items())]
        cfg = self.cfg
        return lambda info: shortfall(nodes, ModelCost.of(info, cfg.kv_reserve_tokens, cfg.kv_bits, cfg.kv_group_size))

    def readiness(self) -> tuple[bool, str]:
        if self.stopping:
            return False, STOPPING
        return self.status.readiness() if self.status else (False, "starting")

    def local_status(self) -> dict:
        return self.status.local() if self.status else {"node": self.name, "ready": False, "reason": "starting"}

    async def cluster_status(self) -> dict:
        return await self.status.cluster_status()

    def leader_http(self) -> str | None:
        leader = self.cluster.leader if self.cluster else None
        if leader is None:
            return None
        if leader == self.name:
            return f"{self.tls.scheme}://{self.http_addr}"
        info = self.cluster.info_of(leader)
        http = info.get("http")
        return f"{'https' if info.get('https') is True else 'http'}://{http}" if isinstance(http, str) else None

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
        return self.cluster.leader if self.cluster else None

    @property
    def drained(self) -> set[str]:
        return self.cluster.drained if self.cluster else set()

    def _facts(self) -> dict:
        return {
            "addr": self.addr,
            "http": self.http_addr,
            "model": self.model_id,
            "speed": round(self.profile.speed, 2) if self.profile and self.profile.speed else None,
            "device": self.profile.to_wire() if self.profile else None,
            "discovery": {
                "enabled": self.cfg.discovery,
                "advertising": bool(self.discovery and self.discovery.advertising),
                "found": sorted(self.discovery.peers) if self.discovery else [],
            },
            "ring_encryption": self.cfg.ring_encryption,
            "tls": self.tls.mode if self.tls else "off",
            # The leader's instances (the models it serves now), for ringctl ps and the dashboard.
            "instances": self.instances(),
            # This node's stages of those instances (their layers, sessions, load progress).
            "instance_stages": self.stages.status() if self.stages is not None else [],
        }

    def _kv_capacity(self, start: int, end: int) -> int | None:
        return None if self.budget is None else self.budget - self.info.weights.stage(start, end)


def _on_disk(model: str | None) -> bool:
    """Whether ``model`` names a model on this machine (a directory, a GGUF file, Ollama's store),
    not a Hub repo id still to fetch, or nothing."""
    if model is None:
        return False
    return model.startswith(OLLAMA_PREFIX) or Path(model).expanduser().exists()


async def _bind(key: str, host: str, port: int, bind):
    """Run ``bind``; a port in use becomes an error that names the key and the port."""
    try:
        return await bind
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{key}: port {port} on {host} is in use by another process (another ringd?); "
                f"stop it or choose another port (--{key.replace('_', '-')})"
            ) from None
        raise
