"""One ringd daemon: links, its stage, and on the leader the plan, engine and API.

This is the composition root. It routes each frame from the links to the
part that owns it (stage, engine, plan bookkeeping, status), and it turns
membership into a plan on the leader: once the expected nodes are linked the
leader splits the layers, sends the PLAN to every member, and serves once all
of them answer LOADED. When a member dies (or joins) the leader suspends the
requests in flight, plans a new ring over the live members, and replays them
on it once it is loaded; if the live members cannot hold the model within
their memory budgets, requests fail with a 503 that says by how much. Frames
to this node itself never touch a socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import socket
import time
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from wire.frames import Frame, MsgType

from .api import Api
from .compute import ComputeThread
from .election import Announce, Election, ElectionError, Pin, Term
from .config import Config, parse_hostport
from .discovery import Advert, Discovery, DiscoveryError, dial_order, interface_matches, local_addresses, local_networks
from .admission import KvLedger, StageKv
from .device import DeviceProfile, default_cache_dir, probe_speed, read_profile
from .engine import Engine
from .membership import LinkError, Links
from .metrics import Metrics
from .pipeline import KvOptions, StageRunner
from .placement import ModelCost, NodeSpec, Plan, PlacementError, natural_key, plan_for
from .shard import ModelError, ModelInfo, Shard, model_info

log = logging.getLogger(__name__)

# How long /cluster/status waits for each node's answer before listing it as silent.
STATUS_TIMEOUT_S = 2.0
# How often idle sessions are looked for; their timeout is SESSION_IDLE_TIMEOUT_S.
EXPIRE_INTERVAL_S = 30.0
# Membership changes come in bursts (a node and its links, a restart); wait this
# long after one before planning, so a burst makes one plan, not several.
PLAN_SETTLE_S = 0.3
# Plan ids: the election term's number times this, plus the leader's plan count
# in that term, so every plan of a later term has a larger id.
PLANS_PER_TERM = 2**20
# With discovery on and no `nodes` configured, the cluster's first plan waits
# until DISCOVERY_WAIT_S after the node started and DISCOVERY_SETTLE_S after
# the last node joined: registering an advert probes for 1-2 s, and daemons
# started together (at boot) find each other within about a second of that.
# A node found later joins with a re-plan; a one-node ring costs nothing to
# replace, but loading the whole model on one node first would.
DISCOVERY_WAIT_S = 2.5
DISCOVERY_SETTLE_S = 1.5
# Placement counts a node whose speed is unknown (or tiny) as this fraction of
# the fastest, so it still gets layers when it is the only one with room.
SLOWEST_RELATIVE_SPEED = 0.1
# Peers one heartbeat may tell us about: far above any real cluster (a dozen
# Macs), low enough that a confused peer cannot make us dial thousands.
MAX_GOSSIPED_PEERS = 64


def lan_address() -> str:
    """The address this host uses to reach the LAN, without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only, no packet leaves
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def own_addresses(cfg: Config) -> list[str]:
    """The addresses peers may dial us at, best first.

    ``advertise`` if set, else the listen address if it is a specific one, else
    this host's IPv4 addresses: those matching ``prefer_interfaces`` first,
    then the one of the default route, then the rest (loopback only if alone).
    """
    if cfg.advertise:
        return [cfg.advertise]
    if cfg.host not in ("0.0.0.0", "::"):
        return [cfg.host]
    pairs = local_addresses(cfg.prefer_interfaces)
    preferred = [ip for i, ip in pairs if any(interface_matches(p, i, ip) for p in cfg.prefer_interfaces)]
    rest = [ip for _, ip in pairs if ip not in preferred]
    route = lan_address()
    if route in rest:
        rest.remove(route)
        rest.insert(0, route)
    return preferred + rest or [route]


class Daemon:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.name = cfg.name
        self.started = int(time.time())
        self.compute = ComputeThread()
        self.metrics = Metrics(self.name, self.local_status)
        self.api = Api(self)
        self.info: ModelInfo | None = None
        self.tokenizer = None
        self.model_id = cfg.model_id or ""
        self.links: Links | None = None
        self.engine: Engine | None = None
        self.plan: Plan | None = None  # the plan this node runs (or, on the leader, is bringing up)
        self.shard: Shard | None = None
        self.stage: StageRunner | None = None
        self.loaded: dict[str, dict] = {}  # leader: LOADED answers for self.plan
        self.ready = False
        self.reason = "starting"
        self.addr = ""
        self.http_addr = ""
        self._plans_made = 0
        self.drained: set[str] = set()  # nodes `ringctl drain` keeps out of the ring (followers copy the leader's)
        self.election = Election(self.name, cfg.priority, *self._restore_state())
        self.leading = False
        self._plan_task: asyncio.Task | None = None
        self._members_changed = asyncio.Event()
        self._plan_lock = asyncio.Lock()
        self._status_ids = itertools.count(1)
        self._status_waiters: dict[int, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.discovery: Discovery | None = None
        self.profile: DeviceProfile | None = None
        self.budget: int | None = None  # bytes for weights + KV cache, from the profile and memory_budget_gb
        self._networks = []  # this host's IPv4 networks, read at start
        self._started = time.monotonic()
        self._last_join = self._started
        self._members_seen: set[str] = set()

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.model is None:
            raise ModelError("model: no model configured; set model (or RINGD_MODEL, --model)")
        secret = cfg.read_secret()
        self._networks = local_networks()
        loop = asyncio.get_running_loop()
        self.info = await loop.run_in_executor(None, model_info, cfg.model)
        self.tokenizer = await loop.run_in_executor(None, load_tokenizer, self.info.path)
        self.model_id = cfg.model_id or (cfg.model if not Path(cfg.model).expanduser().exists() else self.info.name)
        profile = await loop.run_in_executor(None, read_profile, cfg.capabilities)
        speed = await self.compute.run(probe_speed, default_cache_dir())
        self.profile = dataclasses.replace(profile, speed=speed)
        self.budget = self.profile.budget(cfg.memory_budget_gb)

        http_port = await self.api.start(cfg.http_host, cfg.http_port)
        addresses = own_addresses(cfg)
        advertise = addresses[0]
        handshake_info: dict = {
            "model": self.info.fingerprint, "budget": self.budget, "priority": cfg.priority,
            "profile": self.profile.to_wire(), "api_only": cfg.api_only,
        }  # fmt: skip
        self.links = Links(
            self.name, cfg.cluster, secret, handshake_info, self._on_frame, self._on_members_changed,
            heartbeat=self._heartbeat, heartbeat_interval_s=cfg.heartbeat_interval_s, dead_after_s=cfg.dead_after_s,
        )  # fmt: skip
        ring_port = await self.links.listen(cfg.host, cfg.ring_port)
        self.addr = f"{advertise}:{ring_port}"
        self.http_addr = f"{advertise if cfg.http_host in ('0.0.0.0', '::') else cfg.http_host}:{http_port}"
        # Peers learn these in the handshake; filled in now that the ports are bound.
        handshake_info.update(addr=self.addr, http=self.http_addr)
        for peer in cfg.peers:
            self.links.dial(*parse_hostport(peer))
        if cfg.discovery:
            self._spawn(self._discover(addresses, ring_port, http_port))
        self._spawn(self._expire_loop())
        log.info(
            "ringd node %s up: ring %s, http %s, model %s (%d layers), priority %d",
            self.name, self.addr, self.http_addr, self.model_id, self.info.num_layers, cfg.priority,
        )  # fmt: skip
        self._on_members_changed()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()  # goodbyes, so peers' browsers forget us now
        await self.api.stop()
        if self.links is not None:
            await self.links.close()
        self.compute.shutdown()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        if advert.node in self.links.peers:
            return  # linked already (a static peer, gossip, or it dialed us)
        host = dial_order(advert.addresses, self._networks)[0]
        log.info("dialing %s at %s:%d (found by Bonjour)", advert.node, host, advert.ring_port)
        self.links.dial(host, advert.ring_port)

    # --- routing ----------------------------------------------------------------------

    def send(self, node: str, frame: Frame) -> None:
        """Deliver to ``node``: over its link, or straight to our own parts."""
        if node == self.name:
            self._on_frame(self.name, frame)
        else:
            self.links.send(node, frame)

    def _send_from_stage(self, node: str, frame: Frame) -> None:
        try:
            self.send(node, frame)
        except LinkError as e:
            log.warning("req=%x: cannot pass %s on: %s", frame.request_id, frame.type.name, e)
            if frame.type == MsgType.FORWARD and self.plan is not None and node != self.plan.leader:
                self._report(frame.request_id, frame.descriptor.get("term"), f"{e}; the ring is broken")

    def _report(self, rid: int, term, message: str) -> None:
        try:
            self.send(self.plan.leader, Frame(MsgType.ERROR, rid, {"node": self.name, "message": message, "term": term}))
        except LinkError:
            log.warning("req=%x: leader unreachable to report: %s", rid, message)

    def _on_frame(self, peer: str, frame: Frame) -> None:
        try:
            self._dispatch(peer, frame)
        except Exception:  # one bad frame must not end the link or the node
            log.exception("error handling %s frame from %s", frame.type.name, peer)

    def _dispatch(self, peer: str, frame: Frame) -> None:
        t = frame.type
        if t in (MsgType.FORWARD, MsgType.RELEASE):
            if self.stage is not None:
                self.stage.handle(frame)
            elif t == MsgType.FORWARD:
                error = {"node": self.name, "message": "no stage loaded here", "term": frame.descriptor.get("term")}
                self.send(peer, Frame(MsgType.ERROR, frame.request_id, error))
        elif t in (MsgType.TOKEN, MsgType.ERROR):
            if self.engine is not None:
                self.engine.on_frame(frame)
        elif t == MsgType.PLAN:
            self._spawn(self._on_plan(peer, frame.descriptor))
        elif t == MsgType.LOADED:
            self._on_loaded(peer, frame.descriptor)
        elif t == MsgType.STATUS:
            self.send(peer, Frame(MsgType.STATUS_REPLY, 0, {"id": frame.descriptor.get("id"), "status": self.local_status()}))
        elif t == MsgType.STATUS_REPLY:
            waiter = self._status_waiters.pop(frame.descriptor.get("id"), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(frame.descriptor.get("status"))
        elif t in (MsgType.PING, MsgType.CONTROL):
            self._on_heartbeat(peer, frame.descriptor)
        else:
            log.debug("ignoring %s frame from %s", t.name, peer)

    # --- plan: leader side --------------------------------------------------------------

    # --- election -------------------------------------------------------------------------

    def _state_file(self) -> Path:
        return Path(self.cfg.state_dir).expanduser() / f"{self.cfg.cluster}-{self.name}.json"

    def _restore_state(self) -> tuple[Pin, Term | None]:
        """The pin and term this node had before a restart (a pin outlives restarts)."""
        try:
            d = json.loads(self._state_file().read_text())
            return Pin.from_wire(d["pin"]), Term.from_wire(d["term"])
        except FileNotFoundError:
            return Pin(), None
        except (OSError, ValueError, KeyError, ElectionError) as e:
            log.warning("ignoring unreadable state file %s: %s", self._state_file(), e)
            return Pin(), None

    def _save_state(self) -> None:
        path = self._state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pin": self.election.pin.to_wire(), "term": self.election.term.to_wire()}))
        os.replace(tmp, path)

    def _heartbeat(self) -> dict:
        """What every peer hears from us each heartbeat: our election state (a lost
        message is repeated) and whom we are linked with, so that one static peer is
        enough to find the rest of the cluster."""
        known = {p: peer.info["addr"] for p, peer in self.links.peers.items() if isinstance(peer.info.get("addr"), str)}
        beat = {"election": self.election.announcement().to_wire(), "knows": known}
        if self.leading:
            # Followers keep the leader's drain list, so a new leader keeps it too.
            beat["drained"] = sorted(self.drained, key=natural_key)
        return beat

    def _on_heartbeat(self, peer: str, d: dict) -> None:
        knows = d.get("knows")
        if isinstance(knows, dict):
            for node, addr in list(knows.items())[:MAX_GOSSIPED_PEERS]:
                if node != self.name and node not in self.links.peers and isinstance(addr, str):
                    try:
                        self.links.dial(*parse_hostport(addr))
                    except ValueError:
                        log.debug("ignoring gossiped address %r of %s from %s", addr, node, peer)
        drained = d.get("drained")
        if peer == self.election.leader and peer != self.name and isinstance(drained, list):
            self.drained = {n for n in drained[:MAX_GOSSIPED_PEERS] if isinstance(n, str)}
        if "election" in d:
            try:
                msg = Announce.from_wire(d["election"])
                self._elect(self.election.receive(peer, msg))
            except ElectionError as e:
                log.warning("ignoring a malformed election message from %s: %s", peer, e)

    def set_pin(self, node: str | None) -> None:
        """`ringctl leader set NODE` / `leader auto`, on whichever node it reached."""
        self._elect(self.election.set_pin(self.election.pin.next(node)))

    def _elect(self, msgs: list) -> None:
        """Persist, announce, then act on what the election decided."""
        if msgs:
            self._save_state()  # before the messages: a term is on disk before anyone hears of it
            for msg in msgs:
                for peer in list(self.links.peers):
                    try:
                        self.links.send(peer, Frame(MsgType.CONTROL, 0, {"election": msg.to_wire()}))
                    except LinkError:
                        pass
        leader = self.election.leader
        if leader == self.name and not self.leading:
            self._lead()
        elif leader != self.name and self.leading:
            self._follow(leader)

    def _lead(self) -> None:
        log.info("leading the cluster (term %s)", self.election.term.to_wire())
        self.leading = True
        cfg = self.cfg
        kv = None
        if cfg.max_kv_size is not None or cfg.kv_bits is not None:
            kv = KvOptions(cfg.max_kv_size, cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start)
        self.engine = Engine(
            self.name, self.tokenizer, self.send, cfg.prefill_chunk_tokens, kv=kv,
            prefix_cache_entries=cfg.prefix_cache_entries, max_queued=cfg.max_queued_requests,
            queue_timeout_s=cfg.queue_timeout_s,
        )  # fmt: skip
        self._plan_task = self._spawn(self._plan_loop())
        self._members_changed.set()

    def _follow(self, leader: str | None) -> None:
        log.info("following %s", leader or "nobody yet")
        self.leading = False
        if self._plan_task is not None:
            self._plan_task.cancel()
            self._plan_task = None
        if self.engine is not None:
            self.engine.fail_all(f"leadership moved to {leader}; retry")
            self.engine = None
        self.ready, self.reason = False, f"waiting for a plan from {leader or 'a new leader'}"

    def drain(self, node: str, undo: bool) -> None:
        (self.drained.discard if undo else self.drained.add)(node)
        log.info("%s %s", "undrained" if undo else "draining", node)
        self._members_changed.set()

    def _on_members_changed(self) -> None:
        if self.links is not None and set(self.links.peers) - self._members_seen:
            self._last_join = time.monotonic()
        self._members_seen = set(self.links.peers) if self.links is not None else set()
        members = {self.name: self.cfg.priority}
        for p, peer in self.links.peers.items():
            priority = peer.info.get("priority", 0)
            members[p] = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        self._elect(self.election.view(members))
        self._members_changed.set()
        plan = self.plan
        if plan is None or self.links is None:
            return
        gone = [s.node for s in plan.stages if s.node != self.name and s.node not in self.links.peers]
        if gone and self.ready:
            self.ready = False
            self.reason = f"node {gone[0]} left the ring; re-planning over the survivors"
            log.warning("ring down: %s", self.reason)
            if self.engine is not None:
                self.engine.suspend_all(self.reason)

    async def _plan_loop(self) -> None:
        # A leader taking over a running cluster plans at once over whoever is live;
        # only the cluster's very first plan waits for the expected number of nodes.
        planned = self.plan is not None
        while True:
            await self._members_changed.wait()
            await asyncio.sleep(PLAN_SETTLE_S)
            self._members_changed.clear()
            peers = sorted((p for p in self.links.peers if p not in self.drained), key=natural_key)
            need = self.cfg.expected_nodes
            settle = max(self._started + DISCOVERY_WAIT_S, self._last_join + DISCOVERY_SETTLE_S) - time.monotonic()
            if not planned and self.cfg.discovery and self.cfg.nodes is None and settle > 0:
                # Bonjour finds nodes over a few seconds; plan once they stop arriving.
                self.ready = False
                self.reason = f"discovering nodes (linked: {', '.join(peers) or 'none'})"
                await asyncio.sleep(settle)
                self._members_changed.set()
                continue
            if not planned and len(peers) + 1 < need:
                self.ready = False
                self.reason = f"waiting for {need - 1 - len(peers)} more node(s) of {need} (linked: {', '.join(peers) or 'none'})"
                continue
            specs = self._node_specs(peers)
            holders = [n.node for n in specs if not n.api_only]
            if self.plan is not None and self.plan.leader == self.name and [s.node for s in self.plan.stages] == holders:
                continue  # the same ring; nothing to do
            self._plans_made += 1
            plan_id = self.election.term.number * PLANS_PER_TERM + self._plans_made
            split = self.cfg.split if self.cfg.split is not None and len(self.cfg.split) == len(holders) else None
            try:
                plan = plan_for(
                    plan_id, self.name, self.info.fingerprint, specs, self._model_cost(), self.cfg.placement, split
                )  # fmt: skip
            except PlacementError as e:
                self.ready, self.reason = False, f"cannot place the model: {e}"
                log.error(self.reason)
                self.engine.fail_all(self.reason)
                continue
            planned = True
            self.ready, self.reason = False, f"loading plan term {plan.term}"
            self.engine.suspend_all(self.reason)
            self.plan, self.loaded = plan, {}
            log.info("plan term %d: %s", plan.term, ", ".join(f"{s.node}[{s.start},{s.end})" for s in plan.stages))
            # Every linked node hears it: those left out (drained) drop their layers.
            for node in [s.node for s in plan.stages] + [p for p in self.links.peers if plan.index_of(p) is None]:
                try:
                    self.send(node, Frame(MsgType.PLAN, 0, plan.to_wire()))
                except LinkError as e:
                    log.warning("could not send the plan to %s: %s", node, e)

    def _on_loaded(self, peer: str, d: dict) -> None:
        plan = self.plan
        if self.engine is None or plan is None or d.get("term") != plan.term:
            return
        self.loaded[peer] = d
        if d.get("error"):
            self.ready, self.reason = False, f"node {peer} could not load its layers: {d['error']}"
            log.error(self.reason)
            return
        missing = [s.node for s in plan.stages if s.node not in self.loaded]
        if missing:
            self.reason = f"loading plan term {plan.term}; waiting for {', '.join(missing)}"
            return
        self.ready, self.reason = True, ""
        log.info("ring ready: term %d, %d stages, split %s", plan.term, len(plan.stages), plan.split)
        self.engine.set_plan(plan, self._kv_ledger(plan))

    def _node_specs(self, peers: list[str]) -> list[NodeSpec]:
        """The live members as placement sees them, in ring order: the leader, then by name."""
        infos = {self.name: {"addr": self.addr, "profile": self.profile.to_wire(), "api_only": self.cfg.api_only}}
        infos.update({p: self.links.peers[p].info for p in peers if p in self.links.peers})
        speeds = {}
        for node, info in infos.items():
            try:
                speeds[node] = DeviceProfile.from_wire(info.get("profile")).speed or 0.0
            except (TypeError, ValueError):
                speeds[node] = 0.0  # an older or odd peer: the slowest bucket
        fastest = max(speeds.values()) or 1.0
        specs = []
        for node, info in infos.items():
            # Speeds in tenths of the fastest: the probe's own noise (~10% on a
            # busy machine) must not split the layers of identical Macs unevenly.
            speed = max(round(speeds[node] / fastest, 1), SLOWEST_RELATIVE_SPEED)
            specs.append(
                NodeSpec(
                    node, (self.addr if node == self.name else self.links.addr_of(node)) or "",
                    self._budget_of(node), speed, self.cfg.placement_weights.get(node), info.get("api_only") is True,
                )  # fmt: skip
            )
        return specs

    def _model_cost(self) -> ModelCost:
        w, cfg = self.info.weights, self.cfg
        kv_reserve = self.info.kv_bytes_per_token(cfg.kv_bits, cfg.kv_group_size) * cfg.kv_reserve_tokens
        return ModelCost(tuple(w.layers), w.embed, w.norm, w.head, kv_reserve)

    def _kv_ledger(self, plan: Plan) -> KvLedger:
        """Each stage's KV capacity: what its budget leaves after its weights."""
        cfg = self.cfg
        per_layer = self.info.kv_bytes_per_token(cfg.kv_bits, cfg.kv_group_size)
        stages = []
        for s in plan.stages:
            stages.append(StageKv(s.node, per_layer * s.layers, self._kv_capacity(s.node, s.start, s.end)))
        return KvLedger(stages, cfg.max_kv_size)

    def _kv_capacity(self, node: str, start: int, end: int) -> int | None:
        """KV bytes ``node`` can hold holding layers [start, end): its budget less their weights."""
        budget = self._budget_of(node)
        return None if budget is None else budget - self.info.weights.stage(start, end)

    def _budget_of(self, node: str) -> int | None:
        if node == self.name:
            return self.budget
        peer = self.links.peers.get(node)
        budget = peer.info.get("budget") if peer else None
        return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None

    # --- plan: every node ----------------------------------------------------------------

    async def _on_plan(self, peer: str, d: dict) -> None:
        try:
            plan = Plan.from_wire(d)
        except PlacementError as e:
            log.warning("ignoring a malformed plan from %s: %s", peer, e)
            return
        if peer != plan.leader or plan.leader != self.election.leader:
            log.warning("ignoring a plan from %s: the leader here is %s", peer, self.election.leader)
            return
        if self.plan is not None and plan.leader == self.plan.leader and plan.term < self.plan.term:
            return  # an older plan of the same leader, overtaken
        async with self._plan_lock:
            answer = {"term": plan.term}
            try:
                answer.update(await self._load(plan))
            except Exception as e:  # a load failure is reported to the leader, the node stays up
                log.exception("could not load plan term %d", plan.term)
                answer["error"] = f"{type(e).__name__}: {e}"
            try:
                self.send(plan.leader, Frame(MsgType.LOADED, 0, answer))
            except LinkError as e:
                log.warning("could not answer the plan: %s", e)

    async def _load(self, plan: Plan) -> dict:
        if plan.model != self.info.fingerprint:
            raise ModelError(
                f"the leader serves model {plan.model}, this node has {self.info.fingerprint} "
                f"({self.cfg.model}); every node needs the same model"
            )
        i = plan.index_of(self.name)
        if self.stage is not None:
            self.stage.close()
            self.stage = None
        self.plan = plan
        if i is None:
            self.shard = None
            self.ready, self.reason = False, f"not in the ring of term {plan.term} (drained?); the API is forwarded to {plan.leader}"
            return {}
        want = plan.stages[i]
        if self.shard is None or (self.shard.start, self.shard.end) != (want.start, want.end):
            self.shard = None  # free the old layers before loading new ones
            self.reason = f"loading layers [{want.start}, {want.end})"
            t0 = time.monotonic()
            self.shard = await self.compute.run(Shard.load, self.cfg.model, want.start, want.end)
            log.info(
                "loaded layers [%d, %d) in %.1f s: %.1f MiB of parameters",
                want.start, want.end, time.monotonic() - t0, self.shard.parameter_bytes / 2**20,
            )  # fmt: skip
        self.stage = StageRunner(self.name, plan, self.shard, self.compute, self._send_from_stage)
        successor = plan.successor(self.name)
        if successor is not None and successor.node not in self.links.peers and successor.addr:
            self.links.dial(*parse_hostport(successor.addr))
        if not self.leading:
            self.ready, self.reason = True, ""
        return {"parameter_bytes": self.shard.parameter_bytes}

    # --- status ----------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        return self.ready, self.reason

    def leader_http(self) -> str | None:
        leader = self.election.leader
        if leader is None or self.links is None:
            return None
        if leader == self.name:
            return f"http://{self.http_addr}"
        peer = self.links.peers.get(leader)
        return f"http://{peer.info['http']}" if peer and peer.info.get("http") else None

    def local_status(self) -> dict:
        stage = self.stage
        plan = self.plan
        return {
            "node": self.name,
            "role": "leader" if self.leading else "follower",
            "leader": self.election.leader,
            "election_term": self.election.term.to_wire(),
            "pin": self.election.pin.node,
            "ready": self.ready,
            "term": plan.term if plan else 0,
            "addr": self.addr,
            "http": self.http_addr,
            "model": self.model_id,
            "stage": plan.index_of(self.name) if plan else None,
            "layers": [stage.shard.start, stage.shard.end] if stage else None,
            "sessions": len(stage.sessions) if stage else 0,
            "kv_bytes": stage.sessions.kv_bytes if stage else 0,
            "parameter_bytes": self.shard.parameter_bytes if self.shard else 0,
            "budget": self.budget,
            "kv_capacity": self._kv_capacity(self.name, stage.shard.start, stage.shard.end) if stage else None,
            "prefix_entries": stage.sessions.stored if stage else 0,
            "speed": round(self.profile.speed, 2) if self.profile and self.profile.speed else None,
            "device": self.profile.to_wire() if self.profile else None,
            "queued_requests": self.engine.queued if self.engine else 0,
            "active_requests": self.engine.active if self.engine else 0,
            "peers": sorted(self.links.peers, key=natural_key) if self.links else [],
            "drained": sorted(self.drained, key=natural_key),
            "discovery": self._discovery_status(),
        }

    def _discovery_status(self) -> dict:
        d = self.discovery
        return {
            "enabled": self.cfg.discovery,
            "advertising": bool(d and d.advertising),
            "found": sorted(d.peers, key=natural_key) if d else [],
        }

    async def cluster_status(self) -> dict:
        # The ring's members in ring order, then everyone else linked (drained,
        # joining, or outside a plan that could not be made).
        nodes = [s.node for s in self.plan.stages] if self.plan else []
        others = [self.name, *self.links.peers] if self.links else [self.name]
        nodes += sorted(set(others) - set(nodes), key=natural_key)
        statuses = await asyncio.gather(*(self._status_of(n) for n in nodes))
        ready, reason = self.readiness()
        return {
            "node": self.name,
            "leader": self.election.leader,
            "ready": ready,
            "reason": reason,
            "plan": self.plan.to_wire() if self.plan else None,
            "nodes": statuses,
        }

    async def _status_of(self, node: str) -> dict:
        if node == self.name:
            return self.local_status()
        sid = next(self._status_ids)
        waiter = asyncio.get_running_loop().create_future()
        self._status_waiters[sid] = waiter
        try:
            self.send(node, Frame(MsgType.STATUS, 0, {"id": sid}))
            return await asyncio.wait_for(waiter, STATUS_TIMEOUT_S)
        except (LinkError, asyncio.TimeoutError) as e:
            return {"node": node, "ready": False, "error": f"no answer: {e or 'timed out'}"}
        finally:
            self._status_waiters.pop(sid, None)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            if self.stage is not None:
                self.stage.expire_idle()
