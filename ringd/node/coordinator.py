"""The leader's side of the cluster: reconcile the ring against the members, plan, serve.

While this node leads, a loop asks the ``Reconciler`` what to do, on every
change it hears of and at least once per heartbeat interval: make a fresh plan
(under a fresh term, placed over the holders by their budgets and speeds, sent
to every member), send the current plan again to members outside it, or
nothing. It owns the ``Engine``: requests in flight are suspended while a new
ring loads and replayed on it once every stage has loaded its layers; if the
members cannot hold the model, they fail with a 503 that says by how much.

Only the very first plan of a cluster waits: for the expected number of nodes,
or, with discovery on and no ``nodes`` configured, until nodes stop arriving.
A leader that takes over a running cluster plans at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any, Protocol

from ringd.cluster.election import Term
from ringd.cluster.groups import MAX_AUTO_GROUP, Grouping, choose_groups
from ringd.cluster.linkcost import RTT_SAMPLES
from ringd.cluster.links import LinkError
from ringd.cluster.members import Cluster
from ringd.cluster.placement import ModelCost, NodeSpec, fit_note, plan_for, tensor_groups
from ringd.cluster.reconcile import Member, Reconciler
from ringd.cluster.topology import Layout, choose, link_matrix
from ringd.node.stages import Stages, Unload
from ringd.node.config import Config
from ringd.leader.admission import KvLedger, StageKv
from ringd.ring.kvcost import KvCost
from ringd.leader.draft import Drafter
from ringd.leader.engine import Engine
from ringd.leader.errors import EngineError
from ringd.base.logs import about
from ringd.base.metrics import Metrics
from ringd.models.checkpoint import ModelInfo
from ringd.ring.plan import PlacementError, Plan, with_groups
from ringd.stage.shard import tensor_parallel_refusal
from ringd.base.names import natural_key
from ringd.base.tasks import Supervisor
from wire.frames import Frame, MsgType

log = logging.getLogger(__name__)

# Membership changes come in bursts (a node and its links, a restart); wait this
# long after one before planning, so a burst makes one plan, not several.
PLAN_SETTLE_S = 0.3
# With discovery on and no `nodes` configured, the cluster's first plan waits
# until DISCOVERY_WAIT_S after the node started and DISCOVERY_SETTLE_S after
# the last node joined: registering an advert probes for 1-2 s, and daemons
# started together (at boot) find each other within about a second of that.
# A node found later joins with a re-plan; a one-node ring costs nothing to
# replace, but loading the whole model on one node first would.
DISCOVERY_WAIT_S = 2.5
DISCOVERY_SETTLE_S = 1.5
# A ring re-placed for its links (a Mac left out, the order changed) runs at least
# this long before its links re-place it again: each re-plan reloads layers, and a
# link that flaps between fast and slow (Wi-Fi roaming) must not reload every few seconds.
LINK_REPLAN_INTERVAL_S = 30.0
# Bytes per element of the hidden state a hop carries, which a link's bandwidth
# prices: the bf16/fp16 activations of nearly every checkpoint.
HOP_ITEM_BYTES = 2
# Placement counts a node whose speed is unknown (or tiny) as this fraction of
# the fastest, so it still gets layers when it is the only one with room.
SLOWEST_RELATIVE_SPEED = 0.1


@dataclasses.dataclass(frozen=True)
class NodeParts:
    """What of its node every instance the leader serves uses (``daemon.Node`` makes it once)."""

    cfg: Config
    cluster: Cluster
    stages: Stages  # this node's stages: an instance's own, when its plan gives this node layers
    supervisor: Supervisor
    metrics: Metrics
    started: float  # when the node started (time.monotonic): the cluster's first plan waits for nodes from then


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The model an instance serves, as the leader read it."""

    instance: str  # the pool's name for the instance ("": the model the cluster was started with)
    source: str  # the name nodes find its model by in their model lists ("": each node's configured model)
    info: ModelInfo
    tokenizer: Any
    drafter: Drafter | None = None  # speculative decoding's draft model (the configured model's only)


class Share(Protocol):
    """What an instance gets of the nodes beside the other instances (``pool.Pool``)."""

    def room(self, instance: str, node: str) -> int | None:
        """Bytes ``node`` leaves ``instance`` for its weights and reserve (None: unknown)."""

    def kv_room(self, instance: str, node: str) -> int | None:
        """Bytes of ``node``'s KV memory that are ``instance``'s (None: unknown)."""

    def nodes_for(self, instance: str) -> frozenset[str] | None:
        """The nodes ``instance`` may place its ring over (None: any)."""


class Coordinator:
    """Exists while this node leads, one for each instance; ``close`` when it stops."""

    def __init__(self, parts: NodeParts, served: ServedModel, share: Share, planned_before: bool):
        cfg, cluster = parts.cfg, parts.cluster
        self.cfg = cfg
        self.info = served.info
        self.tokenizer = served.tokenizer
        self.cluster = cluster
        self.node = cluster.node
        # Which of the pool's instances this ring serves and the name nodes find its model by;
        # this node's stage of it (made when the plan reaches it); and what each node's memory
        # leaves this instance beside the others (``share``).
        self.instance, self.source = served.instance, served.source
        self._stages = parts.stages
        self._share = share
        self.metrics = parts.metrics
        self.reconciler = Reconciler(self.node, cfg.heartbeat_interval_s)
        self.plan: Plan | None = None
        # The ring's order and the Macs left out by their links, with the figures and why
        # (topology.py); None where a configured split fixes the ring, or before the first plan.
        self.layout: Layout | None = None
        self.grouping: Grouping | None = None  # tensor_parallel auto: the groups chosen, and why
        self._link_replanned = -LINK_REPLAN_INTERVAL_S
        # The links as measured over the last window in which the ring was loaded and idle, and
        # since when it has been: a node computing reads its beats late (on a CPU shared with its
        # stage, milliseconds), so figures taken under load would count compute as link; and a
        # re-plan while idle suspends no request.
        self._quiet_links: dict = {}
        self._quiet_since = 0.0
        self.ready = False
        self.reason = "leading; planning the ring"
        self._started = parts.started
        self._first = not planned_before  # only the cluster's very first plan waits for nodes
        self._seen: set[str] = set(cluster.peers)
        self._last_join = parts.started
        self._burst = True  # membership changed since the last tick: let the burst settle first
        self._changed = asyncio.Event()
        self._changed.set()
        self.engine = Engine(self.node, served.tokenizer, cluster.send, cfg.engine_settings(), parts.metrics, served.drafter)
        self._closed = False
        # Set after every tick: what waits for this ring to serve (a model loaded on demand) looks again.
        self._ticked = asyncio.Event()
        self.failure = ""  # why the last plan could not be placed or loaded ("" while none failed)
        self._task = parts.supervisor.forever(f"reconcile {self.instance}" if self.instance else "reconcile", self._loop, restart_on_return=False)

    def close(self, reason: str) -> None:
        self._closed = True
        self.ready, self.reason = False, reason  # what a request still routed here is told
        self._task.cancel()
        self.engine.fail_all(reason)
        self.reconciler.reset()
        self._ticked.set()  # whoever waits for this ring to serve hears why it never will

    def changed(self) -> None:
        """Something the ring depends on may have changed: reconcile soon."""
        peers = set(self.cluster.peers)
        if peers - self._seen:
            self._last_join = time.monotonic()
        if peers != self._seen:
            self._burst = True
        self._seen = peers
        plan = self.plan
        if plan is not None and self.ready and not self.cluster.settling:
            gone = [n for n in plan.nodes if n != self.node and n not in self.cluster.peers]
            if gone and all(g in self.cluster.left for g in gone):
                # They said LEAVE (a Mac shutting down, an update): expected, not a fault.
                self._down(f"{', '.join(gone)} left; re-planning over the rest", level=logging.INFO)
            elif gone:
                # Stop feeding a broken ring now; the next tick re-plans.
                self._down(f"node {gone[0]} left the ring; re-planning over the survivors")
        self._changed.set()

    def serving(self) -> tuple[Term | None, str]:
        return (self.reconciler.term if self.ready else None), self.reason

    def on_frame(self, peer: str, frame: Frame) -> None:
        """TOKEN and ERROR frames: the engine's, if they come from this ring."""
        self.engine.on_frame(peer, frame)

    # --- the loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        interval = self.cfg.heartbeat_interval_s
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancel that lands as the event is set, and a coordinator closed that
            # way would go on planning as a follower.
            try:
                async with asyncio.timeout(interval):
                    await self._changed.wait()
            except TimeoutError:
                pass
            if self._burst:
                self._burst = False
                await asyncio.sleep(PLAN_SETTLE_S)  # let a burst of membership changes land
            self._changed.clear()
            if self._closed:
                return  # this node stopped leading
            self.engine.watch()
            if self.cluster.settling:
                # A peer said LEAVE: plan once it is out (the cluster calls changed() then),
                # or not at all if this node is stopping too.
                continue
            self._tick()
            self._ticked.set()

    async def wait_ready(self, timeout_s: float) -> None:
        """Returns once this ring serves; EngineError 503 if it cannot be placed or loaded, or
        is not ready within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self.ready:
                    if self.failure or self._closed:
                        raise EngineError(self.failure or self.reason, 503)
                    self._ticked.clear()
                    await self._ticked.wait()
        except TimeoutError:
            raise EngineError(f"{self.label} was not ready within {timeout_s:.0f} s: {self.reason}", 503) from None

    def _members(self) -> dict[str, Member]:
        cluster = self.cluster
        host = self._stages.named(self.instance)
        allowed = self._share.nodes_for(self.instance)  # a replica's share of the nodes (None: any)
        own = not self.cfg.api_only and self.node not in cluster.drained and (allowed is None or self.node in allowed)
        members = {self.node: Member(0, own, host.report if host is not None else None)}
        for p, peer in cluster.peers.items():
            holder = p not in cluster.drained and not peer.info.api_only and (allowed is None or p in allowed)
            members[p] = Member(peer.number, holder, cluster.report_of(p, self.instance))
        return members

    def _hold(self, members: dict[str, Member]) -> str | None:
        """Why the cluster's first plan should wait, or None."""
        if not self._first:
            return None
        linked = ", ".join(sorted(self.cluster.peers, key=natural_key)) or "none"
        cfg = self.cfg
        if cfg.discovery and cfg.nodes is None:
            settle = max(self._started + DISCOVERY_WAIT_S, self._last_join + DISCOVERY_SETTLE_S) - time.monotonic()
            if settle > 0:
                asyncio.get_running_loop().call_later(settle, self._changed.set)
                return f"discovering nodes (linked: {linked})"
            return None
        need = cfg.expected_nodes
        if len(members) < need:
            return f"waiting for {need - len(members)} more node(s) of {need} (linked: {linked})"
        return None

    def _tick(self) -> None:
        now = time.monotonic()
        members = self._members()
        decision = self.reconciler.tick(now, members, self._hold(members))
        self.failure = decision.reason if decision.failed else ""
        if decision.plan_over is not None:
            self._make_plan(now, decision.plan_over, members, decision.reason)
            return
        why = self._links_moved(now)
        if why is not None:
            self._link_replanned = now
            self._make_plan(now, self.reconciler.over, members, why)
            return
        plan = self.plan
        for node in decision.inform:
            self._send_plan(node, plan)
        if decision.ready and not self.ready:
            unusable = self._kv_options_unusable(plan)
            if unusable:
                if self.reason != unusable:
                    log.error("ring loaded but cannot serve: %s", unusable)
                    self.engine.fail_all(unusable)
                self.reason = unusable
                return
            self.ready, self.reason, self._quiet_since = True, "", now
            log.info("ring ready: term %d, %d stages, split %s", plan.term, len(plan.stages), plan.split, extra=about(term=plan.term))
            self.engine.set_plan(plan, self._kv_ledger(plan), _prefix_limit(self.stage_costs(plan)))
        elif not decision.ready:
            if self.ready:
                self._down(decision.reason)
            self.reason = decision.reason

    def _kv_options_unusable(self, plan: Plan) -> str:
        """Why this model cannot run with the configured KV options ("" if it can).

        mlx-lm quantizes only caches that grow with the context: its rotating
        (sliding-window) caches raise when asked to, and linear-attention state has no
        quantized form. Every request would fail on a stage; better one clear reason.
        """
        if self.cfg.kv_bits is None:
            return ""
        if any(cost.windows for cost in self.stage_costs(plan)):
            return (
                f"kv_bits {self.cfg.kv_bits} is set, but {self.info.model_type} has sliding-window caches, "
                "which mlx-lm cannot quantize; unset kv_bits (or RINGD_KV_BITS) for this model"
            )
        return ""

    def _down(self, reason: str, level: int = logging.WARNING) -> None:
        self.ready, self.reason = False, reason
        log.log(level, "ring down: %s" if level >= logging.WARNING else "%s", reason)
        self.engine.suspend_all(reason)

    def _split(self, over: tuple[str, ...]) -> list[int] | None:
        """The configured split, where it applies to this ring (it fixes the ring: no layout by links)."""
        if self.cfg.tensor_parallel == "auto":
            return None  # the config refuses both at once
        stages = len(over) // self.cfg.tensor_parallel
        return self.cfg.split if self.cfg.split is not None and len(self.cfg.split) == stages and not self.instance else None

    def _layout(self, specs: list[NodeSpec]) -> Layout:
        """The ring over ``specs`` that the links favour as measured while the ring was idle,
        sticking to the running one."""
        by_node, cost = {s.node: s for s in specs}, self._model_cost()
        links = self._quiet_links
        hop_bytes = self.info.hidden_size * HOP_ITEM_BYTES
        return choose(self.node, [s.node for s in specs], links, lambda nodes: fit_note([by_node[n] for n in nodes], cost), hop_bytes, self.layout)

    def _links_moved(self, now: float) -> str | None:
        """Why the serving ring should be re-placed for its links (a Mac's links turned slow or
        fast, a cheaper order), or None; refreshes the figures ``ringctl plan`` shows."""
        over = self.reconciler.over
        if not self.ready or self.engine.active or self.engine.queued:
            self._quiet_since = now
            return None
        if now - self._quiet_since < RTT_SAMPLES * self.cfg.heartbeat_interval_s:
            return None  # the links' figures still hold samples from while the ring loaded or computed
        self._quiet_links = link_matrix(self.cluster.link_views())
        if self.layout is None or over is None or self._split(over) is not None:
            return None
        new = self._layout(self._node_specs(over))
        same = (new.ring, new.out) == (self.layout.ring, self.layout.out)
        regroup = self._regroup(self.layout.ring) if same and self.cfg.tensor_parallel == "auto" else None
        if same and regroup is None:
            self.layout = new
            return None
        if now - self._link_replanned < LINK_REPLAN_INTERVAL_S:
            return None
        if regroup is not None:
            return regroup
        gone = [why for n, why in new.left_out if n not in self.layout.out]
        back = sorted(self.layout.out - new.out, key=natural_key)
        parts = gone + ([f"{', '.join(back)} back in: its links are no longer slow"] if back else [])
        return "; ".join(parts) or f"the links favour the ring {' -> '.join(new.ring)} ({new.cost_us / 1000:.2f} ms of links a token)"

    def _make_plan(self, now: float, over: tuple[str, ...], members: dict[str, Member], why: str) -> None:
        specs = self._node_specs(over)
        split = self._split(over)
        layout = None
        if split is None:
            # Ring order and who holds layers by the links (node-name order while none are measured).
            layout = self._layout(specs)
            by_node = {s.node: s for s in specs}
            specs = [by_node[n] for n in layout.ring] + [dataclasses.replace(by_node[n], api_only=True) for n, _ in layout.left_out]
            if self.cfg.tensor_parallel == "auto":
                self.grouping = self._groups(layout.ring)
                log.info("tensor_parallel auto: %s", self.grouping.why)
                order = [m for g in self.grouping.groups for m in g]
                specs = [by_node[n] for n in order] + [s for s in specs if s.node not in order]
        term = self.cluster.claim_plan_term()
        try:
            plan = self._place(term.number, specs, split)
        except PlacementError as e:
            reason = f"cannot place {self.label}: {e}"
            if self._share.nodes_for(self.instance) == frozenset():  # a replica whose share of the Macs is gone
                reason = f"cannot place {self.label}: every Mac of its share of the cluster is gone; the model's other replicas serve its requests"
            log.error(reason)
            self.failure = reason
            self.reconciler.placement_failed(now, over, reason)
            self.ready, self.reason, self.plan = False, reason, None
            self.engine.fail_all(reason)
            return
        self._first = False
        self.reconciler.planned(now, term, plan.nodes, over, members)
        self.plan, self.layout = plan, layout
        for node, reason in layout.left_out if layout else ():
            log.info("%s", reason, extra=about(term=plan.term))
        self.metrics.plans.inc()
        if self.ready:
            self.ready = False
        self.reason = f"loading plan term {plan.term}"
        self.engine.suspend_all(self.reason)
        log.info(
            "plan term %d%s (%s): %s", plan.term, f" of {self.instance}" if self.instance else "", why, ", ".join(f"{'+'.join(s.members)}[{s.start},{s.end})" for s in plan.stages),
            extra=about(term=plan.term, why=why, split=plan.split, nodes=list(plan.nodes)),
        )  # fmt: skip
        # Every member hears it, this node included: those left out drop their layers.
        for node in members:
            self._send_plan(node, plan)

    def _groups(self, ring: tuple[str, ...], current: Grouping | None = None) -> Grouping:
        """tensor_parallel auto: the groups the measured links and each Mac's speed favour."""
        layer_us = {}
        for node in ring:
            profile = self.cluster.info_of(node).profile
            speed = profile.speed if profile is not None and profile.speed else None
            layer_us[node] = self._layer_flops() / (speed * 1e3) if speed else float("inf")
        allowed = [k for k in self._group_sizes if k <= len(ring)]
        return choose_groups(ring, self._quiet_links, layer_us, self.info.num_layers, self.info.hidden_size * HOP_ITEM_BYTES, allowed, current)

    @functools.cached_property
    def _group_sizes(self) -> list[int]:
        """The group sizes this instance's model splits into (its heads divide): the same for the
        instance's life, and _groups asks every quiet heartbeat."""
        return [k for k in range(2, MAX_AUTO_GROUP + 1) if tensor_parallel_refusal(self.info, k) is None]

    def _layer_flops(self) -> float:
        """A layer's decode, in operations: about two per parameter (a parameter's bytes by the
        checkpoint's dtype; a quantized one's are fewer, and its estimate lower)."""
        w = self.info.weights
        dtype = str(self.info.config.get("torch_dtype", "bfloat16"))
        return 2 * (sum(w.layers) / max(1, len(w.layers))) / (4 if "32" in dtype else 2)

    def _regroup(self, ring: tuple[str, ...]) -> str | None:
        """Why the running groups should change for what the links and compute now say, or None."""
        new = self._groups(ring, self.grouping)
        if self.grouping is not None and new.groups == self.grouping.groups:
            self.grouping = new  # the figures ringctl plan shows
            return None
        return f"tensor_parallel auto: {new.why}"

    def _place(self, term: int, specs: list[NodeSpec], split: list[int] | None) -> Plan:
        """The plan over ``specs`` (ring order): with tensor_parallel, consecutive holders in groups,
        each group placed as one node holding a slice of its layers on every member."""
        cost, size = self._model_cost(), self.cfg.tensor_parallel
        if size == "auto":
            size = self.grouping.size if self.grouping is not None else 1
        holders = sum(not s.api_only for s in specs)
        if 1 < holders < size:
            # Fewer Macs than a group (the rest died, or the pool gave this instance fewer): serve
            # from each alone, as a ring without groups, rather than not at all.
            log.info("tensor_parallel %d: only %d node(s) may hold %s's layers; no groups", size, holders, self.label)
            size = 1
        if size == 1 or holders == 1:
            plan = plan_for(term, self.node, self.info.fingerprint, specs, cost, self.cfg.placement, split)
            return dataclasses.replace(plan, instance=self.instance, source=self.source)
        refusal = tensor_parallel_refusal(self.info, size)
        if refusal is not None:
            raise PlacementError(f"tensor_parallel {size}: {refusal}")
        grouped, groups, left = tensor_groups(specs, size)
        for _, why in left:
            log.info("%s", why)
        plan = plan_for(term, self.node, self.info.fingerprint, grouped, cost.per_member(size), self.cfg.placement, split)
        return dataclasses.replace(with_groups(plan, groups), instance=self.instance, source=self.source)

    def _send_plan(self, node: str, plan: Plan) -> None:
        try:
            self.cluster.send(node, Frame(MsgType.PLAN, 0, plan.to_wire()))
        except LinkError as e:
            log.warning("could not send plan term %d to %s: %s", plan.term, node, e)

    # --- placement inputs ---------------------------------------------------------------------

    def _node_specs(self, holders: tuple[str, ...]) -> list[NodeSpec]:
        """The holders as placement sees them, in ring order: this node first, then by name."""
        infos = {node: self.cluster.info_of(node) for node in sorted(holders, key=lambda n: n != self.node)}
        # An older or odd peer's speed is unknown: the slowest bucket.
        speeds = {node: (info.profile.speed if info.profile is not None else None) or 0.0 for node, info in infos.items()}
        fastest = max(speeds.values(), default=0.0) or 1.0
        specs = []
        for node, info in infos.items():
            # Speeds in tenths of the fastest: the probe's own noise (~10% on a
            # busy machine) must not split the layers of identical Macs unevenly.
            speed = max(round(speeds[node] / fastest, 1), SLOWEST_RELATIVE_SPEED)
            specs.append(NodeSpec(node, info.addr, self._share.room(self.instance, node), speed, self.cfg.placement_weights.get(node), False))
        return specs

    def _model_cost(self) -> ModelCost:
        cfg = self.cfg
        return ModelCost.of(self.info, cfg.kv_reserve_tokens, cfg.kv_bits, cfg.kv_group_size)

    def stage_costs(self, plan: Plan) -> list[KvCost]:
        """What a request's caches cost on each stage: as the stage measured them from its own
        caches at load (its report says), else the dense formula over the config."""
        per_layer = self.info.kv_bytes_per_token()
        costs = []
        host = self._stages.named(self.instance)
        for s in plan.stages:
            report = (host.report if host is not None else None) if s.node == self.node else self.cluster.report_of(s.node, self.instance)
            costs.append(report.kv if report is not None and report.kv is not None else KvCost(per_token=per_layer * s.layers))
        return costs

    def _kv_ledger(self, plan: Plan) -> KvLedger:
        """Each stage's KV capacity: what its budget leaves after its weights."""
        cfg = self.cfg
        stages = [
            StageKv(s.node, cost, self.kv_capacity(s.node)) for s, cost in zip(plan.stages, self.stage_costs(plan))
        ]
        return KvLedger(stages, cfg.max_kv_size, cfg.kv_bits, cfg.kv_group_size)

    def kv_capacity(self, node: str) -> int | None:
        """KV bytes ``node`` can hold for this instance: the share of its memory the pool gives it
        beside its weights and the other instances."""
        return self._share.kv_room(self.instance, node)

    def refresh_kv(self) -> None:
        """Each stage's KV capacity again, as the pool's instances share the nodes now."""
        plan, ledger = self.plan, self.engine.admission.ledger
        if self.ready and plan is not None and ledger is not None:
            ledger.resize([self.kv_capacity(s.node) for s in plan.stages])
            self.engine.admission.wake()

    @property
    def label(self) -> str:
        return f"instance {self.instance}" if self.instance else "the model"

    def unload(self, reason: str) -> None:
        """This instance goes: its requests fail with ``reason``, every member drops its layers."""
        plan = self.plan
        self.close(reason)
        if plan is None:
            return
        d = Unload(self.instance, plan.term, self.node).to_wire()
        for node in [self.node, *self.cluster.peers]:
            try:
                self.cluster.send(node, Frame(MsgType.UNLOAD, 0, d))
            except LinkError as e:
                log.warning("could not tell %s to unload %s (its next plan from this leader will): %s", node, self.instance, e)


def _prefix_limit(costs: list[KvCost]) -> tuple[int | None, str]:
    """How long a cached prefix may be for every stage to trim it back (None: any), and why."""
    limits = [c.trim_limit for c in costs if c.trim_limit is not None]
    if not limits:
        return None, ""
    if min(limits) == 0:
        return 0, "prefix reuse is off: this model's linear-attention state cannot be trimmed back to a prefix"
    return min(limits), f"prefix reuse is limited to {min(limits) - 1} tokens: a sliding-window cache cannot be trimmed once it has wrapped"
