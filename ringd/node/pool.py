"""The leader's instances: the models it serves at once, each a ring of its own.

An instance is one model with its own plan, reconciler and engine (a
``Coordinator``). The model the cluster was started with is always one
(pinned: never unloaded). A request naming another model that the model list
holds (``models/catalogue.py``: the Ollama store, the Hugging Face cache,
``models_dir``) loads it on demand: the request waits while the leader places
it over what the nodes' budgets leave beside the instances already there, the
nodes load their layers, and the ring serves. Several instances share a Mac:
each claims its layers' weights and its KV reserve there, and the KV memory
no claim holds is split between those on the node (``cluster/sharing.py``).

Idle instances go: after their ``keep_alive`` (Ollama's semantics: a request
sets it for its model, else the default), or, least recently used first, when
a new instance needs their room. An instance serving requests never goes.

Replicas: ``load(model, replicas=N)`` keeps N instances of one model (named
MODEL, MODEL#2, ...); a request goes to the ready one with the least work
outstanding.

What it ignores: how a request is checked and rendered (``http/``), how a
ring is planned and reconciled (``coordinator.py``), the rules of sharing
(``cluster/sharing.py``), which loads are under way and who waits on each
(``loads.py``, whose commands it carries out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ringd.cluster.placement import ModelCost, NodeSpec, shortfall
from ringd.cluster.sharing import (
    MAX_REPLICAS, Held, Usage, eviction_order, expired, fewest_nodes, kv_shares, pick_replica, regroup, room_left, victims,
)
from ringd.leader.errors import EngineError
from ringd.models.catalogue import Catalogue
from ringd.models.checkpoint import ModelInfo, load_tokenizer
from ringd.models.errors import ModelError
from ringd.models.naming import same_model, tagged
from ringd.models.source import model_info
from ringd.cluster.memberinfo import MemberInfo
from ringd.cluster.messages import MAX_INSTANCES, MAX_KEEP_ALIVE_S, MessageError, PoolModel
from ringd.node.coordinator import Coordinator, NodeParts, ServedModel
from ringd.node.loads import Loads
from ringd.models.ollama.keepalive import format_keep_alive
from ringd.ring.plan import MAX_INSTANCE_CHARS
from ringd.base.names import natural_key
from ringd.ring.steps import term_of
from wire.frames import Frame

log = logging.getLogger(__name__)

# How long a request waits for a model it named to load: reading a large model from a Mac's SSD
# takes a minute or two, fetching its layers from peers longer.
LOAD_TIMEOUT_S = 600.0
# How often idle instances are checked against their keep_alive: Ollama's own granularity is
# seconds, and the check is a pass over a handful of instances.
KEEP_ALIVE_TICK_S = 1.0
# Instances at once (replicas included): each is a ring with its own engine and caches.
MAX_POOL_INSTANCES = 32
REPLICA_MARK = "#"


@dataclass
class Instance:
    """One of the pool's models: what a request is served by (``http/node.Served``)."""

    name: str  # the instance: "" for the configured model, else its list name ("#N" for a replica past the first)
    model: str  # the model's name in the list ("" for the configured model: each node's --model)
    model_id: str  # what requests name it by, and answers call it
    coordinator: Coordinator
    pinned: bool
    keep_alive: float | None  # seconds idle before it unloads; None: never
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.time)
    served: int = 0  # requests routed to it
    # Requests routed to it and not yet ended: counted from the routing on, so requests that
    # arrive together spread over the replicas before any reaches an engine.
    routed: int = 0

    @property
    def info(self) -> ModelInfo:
        return self.coordinator.info

    @property
    def tokenizer(self):
        return self.coordinator.tokenizer

    @property
    def engine(self):
        return self.coordinator.engine

    def readiness(self) -> tuple[bool, str]:
        return self.coordinator.ready, self.coordinator.reason

    @property
    def outstanding(self) -> int:
        return max(self.routed, self.engine.active + self.engine.queued)

    def release(self) -> None:
        self.routed = max(0, self.routed - 1)

    def usage(self, loading: bool = False) -> Usage:
        """As eviction and keep_alive see it; ``loading``: its load is under way, which is work
        (the requests that asked for it wait on it), so it is neither evicted nor expired then."""
        return Usage(self.name, self.pinned, max(self.outstanding, int(loading)), self.last_used, self.keep_alive)

    def status(self, now: float) -> dict:
        c = self.coordinator
        plan = c.plan
        expires = None if self.pinned or self.keep_alive is None else time.time() + max(0.0, self.last_used + self.keep_alive - now)
        return {
            "instance": self.name, "model": self.model_id, "source": self.model, "pinned": self.pinned,
            "ready": c.ready, "reason": c.reason, "loaded_at": self.loaded_at, "expires_at": expires,
            "keep_alive": format_keep_alive(None if self.pinned else self.keep_alive),
            "active": self.engine.active, "queued": self.engine.queued, "served": self.served,
            "term": plan.term if plan else None, "stages": [["+".join(s.members), s.start, s.end] for s in plan.stages] if plan else [],
            "layers": c.info.num_layers, "weights": c.info.weights.stage(0, c.info.num_layers),
        }  # fmt: skip


def holds(rooms: dict[str, int | None], cost: ModelCost) -> bool:
    """Whether nodes with these rooms (bytes each may give it; None: no limit), in this order, hold the model."""
    return shortfall([NodeSpec(n, "", room) for n, room in rooms.items()], cost) is None


def fewest_holding(rooms: dict[str, int | None], cost: ModelCost) -> list[str] | None:
    """The fewest of these nodes that hold the model, those with the most room first
    (``sharing.fewest_nodes``): where a model loaded on demand goes. None if not all of them do."""
    return fewest_nodes(list(rooms.items()), lambda chosen: holds({n: rooms[n] for n in chosen}, cost))


class Pool:
    """Exists while this node leads; ``close`` when it stops."""

    def __init__(
        self, parts: NodeParts, configured: ServedModel, model_id: str, catalogue: Catalogue | None, planned_before: bool,
        restore: tuple[PoolModel, ...] = (),
    ):  # fmt: skip
        """``configured``: the model the cluster was started with, served as ``model_id``; its
        first plan waits for nodes unless ``planned_before`` (a leader taking over a running ring).
        ``restore``: the models the leader before this one kept loaded (its heartbeats said),
        loaded again once the configured model serves."""
        self.cfg = cfg = parts.cfg
        self.parts = parts
        self.catalogue = catalogue
        self.instances: dict[str, Instance] = {}
        # Which models load and who waits on each (loads.py: the state machine); here, the
        # task of each load under way and the future each waiting request is answered by.
        self.loads = Loads()
        self._tasks: dict[str, asyncio.Task] = {}
        self._answers: dict[int, asyncio.Future] = {}
        # Each model with replicas: which nodes each replica places its ring over (sticky).
        self._groups: dict[str, list[frozenset[str]]] = {}
        # Each model loaded on demand alone: the nodes it is placed over, and why.
        self.homes: dict[str, tuple[frozenset[str], str]] = {}
        self._closed = False
        # The models being loaded again after a leader change, by key: told in heartbeats as kept
        # (their stages on followers are kept for them) until they serve or fail.
        self._restoring: dict[str, PoolModel] = {}
        first = Coordinator(parts, configured, self, planned_before)
        self.default = Instance("", "", model_id, first, pinned=True, keep_alive=None)
        self.instances[""] = self.default
        self._task = parts.supervisor.forever("keep_alive", self._expire_loop)
        if cfg.replicas > 1:
            parts.supervisor.once("replicas", self._configured_replicas(cfg.replicas))
        for m in restore:
            if m.model or len(m.instances) > cfg.replicas:  # the configured replicas are loaded above
                self._restoring[tagged(m.model or model_id)] = m
                parts.supervisor.once(f"restore {m.model or model_id}", self._restore(m))

    async def _restore(self, m: PoolModel) -> None:
        """A model the last leader kept loaded, loaded again (its replicas, its keep_alive) once the
        configured model serves; its stages on the followers are still there, and kept when they
        are placed alike. A request naming it meanwhile starts (or waits on) the same load."""
        name, key = m.model or self.default.model_id, tagged(m.model or self.default.model_id)
        try:
            await self.default.coordinator.wait_ready(LOAD_TIMEOUT_S)
            for _ in range(2):  # a request's load of one replica may have been the one joined
                await self.load(name, len(m.instances), m.keep_alive if m.model else False)
                if len(self.replicas_of(name)) >= len(m.instances):
                    break
            if m.model:
                for inst in self.replicas_of(name):
                    inst.keep_alive = m.keep_alive
            log.info("%s loaded again, as the leader before this one kept it", name)
        except EngineError as e:
            if not self._closed:
                log.error("%s, which the leader before this one kept loaded, could not be loaded again: %s", name, e)
        finally:
            self._restoring.pop(key, None)

    def manifest(self) -> tuple[PoolModel, ...]:
        """The models this leader keeps loaded besides the configured one (and the configured
        model's replicas past the first), with those being loaded again: what heartbeats tell."""
        out: dict[str, PoolModel] = {}
        for inst in self.instances.values():
            if inst.keep_alive == 0.0 or (inst.pinned and len(self.replicas_of(inst.model_id)) < 2):
                continue  # going, or the configured model alone
            key = tagged(inst.model_id)
            had = out.get(key)
            names = (*had.instances, inst.name) if had else (inst.name,)
            keep_alive = None if inst.pinned or inst.keep_alive is None else min(inst.keep_alive, MAX_KEEP_ALIVE_S)
            try:
                out[key] = PoolModel(inst.model_id if not inst.pinned else "", keep_alive, names[:MAX_REPLICAS])
            except MessageError as e:  # a name no heartbeat carries (a file name with a control character): not kept
                log.debug("not telling %s in heartbeats: %s", inst.name, e)
        for key, m in self._restoring.items():
            out.setdefault(key, m)
        kept, count = [], 0
        for m in out.values():
            count += len(m.instances)
            if count > MAX_INSTANCES:  # what a heartbeat carries (the pool holds no more anyway)
                break
            kept.append(m)
        return tuple(kept)

    async def _configured_replicas(self, n: int) -> None:
        """``replicas: n``: once the configured model serves, its other n - 1 instances."""
        try:
            await self.default.coordinator.wait_ready(LOAD_TIMEOUT_S)
            await self.load(self.default.model_id, n)
        except EngineError as e:
            if not self._closed:  # closed: this node stopped leading, and the next leader loads them
                log.error("the configured model's %d replicas could not be loaded: %s", n, e)

    def _members(self) -> dict[str, MemberInfo]:
        return self.parts.cluster.member_infos()

    # --- what the daemon calls ----------------------------------------------------------

    def coordinators(self) -> list[Coordinator]:
        return [i.coordinator for i in self.instances.values()]

    def changed(self) -> None:
        for c in self.coordinators():
            c.changed()

    def on_frame(self, peer: str, frame: Frame) -> None:
        """TOKEN and ERROR frames: to the instance whose ring (term) they name."""
        term = term_of(frame)
        for inst in self.instances.values():
            plan = inst.coordinator.plan
            if plan is not None and plan.term == term:
                inst.coordinator.on_frame(peer, frame)
                return
        self.default.coordinator.on_frame(peer, frame)

    def close(self, reason: str) -> None:
        self._closed = True
        self._task.cancel()
        for c in self.coordinators():
            c.close(reason)
        for task in self._tasks.values():
            task.cancel()  # its waiters see the pool closed: the coordinators failed their requests with reason

    # --- routing ------------------------------------------------------------------------

    def find(self, name: str) -> Instance | None:
        """The instance that serves requests naming ``name`` now (the least busy replica), or None."""
        found = [i for i in self.instances.values() if same_model(i.model_id, name)]
        if not found:
            return None
        ready = [i for i in found if i.coordinator.ready] or found
        pick = pick_replica([(i.name, i.outstanding) for i in ready])
        return self.instances[pick]

    async def served(self, name: str | None, keep_alive: float | None | bool = False) -> Instance:
        """The instance for ``name`` (None: the configured model itself), loaded first if none is;
        ``keep_alive`` (False: leave it) sets how long it stays loaded once idle. The request counts
        as its outstanding work until the caller's ``release()``. EngineError 404/400/503 says why
        it cannot serve."""
        inst = self.find(name) if name is not None else self.default
        pending = name is not None and self.loads.loading(tagged(name))
        if inst is None or (pending and not inst.coordinator.ready):
            inst = await self.load(name)  # or waits for the load under way
        if keep_alive is not False and not inst.pinned:
            inst.keep_alive = keep_alive
        inst.last_used = time.monotonic()
        inst.served += 1
        inst.routed += 1  # until the caller's release()
        return inst

    # --- loading and unloading ------------------------------------------------------------

    async def load(self, name: str, replicas: int = 1, keep_alive: float | None | bool = False) -> Instance:
        """Load ``name`` (up to ``replicas`` instances of it) and wait until one serves."""
        if not 1 <= replicas <= MAX_REPLICAS:
            raise EngineError(f"replicas must be from 1 to {MAX_REPLICAS}, got {replicas}", 400)
        if len(name) > MAX_INSTANCE_CHARS or REPLICA_MARK in name:
            raise EngineError(f"model {name[:80]!r} is not a model name (at most {MAX_INSTANCE_CHARS} characters, no {REPLICA_MARK!r})", 400)
        key = tagged(name)
        waiter, start = self.loads.ask(key)
        answer = self._answers[waiter] = asyncio.get_running_loop().create_future()
        for s in start:
            # A task of its own: the client that asked first may go away; the others wait on it still.
            task = self._tasks[s.key] = asyncio.ensure_future(self._load(name, replicas, keep_alive))
            task.add_done_callback(lambda done, key=s.key: self._loaded(key, done))
        try:
            done = await answer  # the load's task, once it has ended
            if done.cancelled():
                raise EngineError(f"the load of {name} was given up: this node stopped leading or is stopping; retry", 503)
            return done.result()
        except EngineError:
            raise
        except asyncio.CancelledError:  # this request's client went: the load goes on for the others
            raise
        except Exception as e:  # a bug, not a reason: said in one line to the client, whole in the log
            raise EngineError(f"could not load {name}: {type(e).__name__}: {e}", 503) from None
        finally:
            del self._answers[waiter]
            self.loads.done(waiter)

    def _loaded(self, key: str, done: asyncio.Task) -> None:
        """A load's task ended: every request waiting on it is answered with it."""
        if self._tasks.get(key) is done:
            del self._tasks[key]
        if not done.cancelled() and done.exception() is not None and not isinstance(done.exception(), EngineError):
            log.error("loading %s failed", key, exc_info=done.exception())
        for waiter in self.loads.ended(key):
            answer = self._answers.get(waiter)
            if answer is not None and not answer.done():
                answer.set_result(done)

    async def _load(self, name: str, replicas: int, keep_alive: float | None | bool) -> Instance:
        holders = sum(not info.api_only for info in self._members().values())
        if replicas > max(holders, 1):
            raise EngineError(f"{replicas} replicas need {replicas} Macs that hold layers, and the cluster has {holders}", 400)
        existing = self.replicas_of(name)
        if not existing:
            model, info, tokenizer = await self._read(name)
            # Another name of a model loaded already (``smollm2`` and ``smollm2.gguf``, one file; the
            # configured model's file by its name in the list): that instance, not a second copy.
            existing = self.replicas_of(next((i.model_id for i in self.instances.values() if i.info.fingerprint == info.fingerprint), name))
            if not existing:
                existing, pinned = [], False
        if existing:
            model, info, tokenizer, pinned = existing[0].model, existing[0].info, existing[0].tokenizer, existing[0].pinned
            name = existing[0].model_id
        first: Instance | None = existing[0] if existing else None
        for k in range(len(existing), replicas):
            label = name if k == 0 else f"{name}{REPLICA_MARK}{k + 1}"
            if len(self.instances) >= MAX_POOL_INSTANCES:
                raise EngineError(f"the cluster serves {MAX_POOL_INSTANCES} instances already; unload one first", 503)
            if k == 0:
                self._make_room(label, info)
            coordinator = Coordinator(self.parts, ServedModel(label, model, info, tokenizer), self, planned_before=True)
            ka = None if pinned else self.cfg.keep_alive if keep_alive is False else keep_alive
            inst = Instance(label, model, name, coordinator, pinned=pinned, keep_alive=ka)
            self.instances[label] = inst
            log.info("loading %s (%s): %d layers%s", label, model or "the configured model", info.num_layers, f", replica {k + 1} of {replicas}" if replicas > 1 else "")
            first = first or inst
        # Every replica (the ones there already re-plan over their share of the nodes) serving.
        for inst in self.replicas_of(name):
            try:
                await inst.coordinator.wait_ready(LOAD_TIMEOUT_S)
            except EngineError:
                if inst.pinned and not inst.name:
                    raise
                self.unload(inst.name, "it could not be loaded", force=True)
                raise
        for c in self.coordinators():
            c.refresh_kv()
        return first

    async def _read(self, name: str) -> tuple[str, ModelInfo, object]:
        """The model ``name`` as the model list holds it: its list name, info and tokenizer."""
        entry = await self.catalogue.lookup(name) if self.catalogue is not None else None
        if entry is None:
            raise EngineError(
                f"model {name!r} is not served here, and the model list holds no model by that name "
                "(GET /v1/models lists what can be served; put models in models_dir)", 404
            )  # fmt: skip
        if entry.facts.info is None:
            raise EngineError(f"model {name!r} cannot be served: {entry.facts.error}", 400)
        loop = asyncio.get_running_loop()
        try:
            info = await loop.run_in_executor(None, model_info, entry.ref)
            tokenizer = await loop.run_in_executor(None, load_tokenizer, info)
        except ModelError as e:
            raise EngineError(f"model {name!r} cannot be served: {e}", 400) from None
        return entry.name, info, tokenizer

    def _cost(self, info: ModelInfo) -> ModelCost:
        cfg = self.cfg
        return ModelCost.of(info, cfg.kv_reserve_tokens, cfg.kv_bits, cfg.kv_group_size)

    def held(self, node: str, skip: frozenset[str] = frozenset()) -> dict[str, Held]:
        """What each placed instance holds on ``node`` (their plans' stages there)."""
        out = {}
        for inst in self.instances.values():
            plan = inst.coordinator.plan
            if inst.name in skip or plan is None:
                continue
            for s in plan.stages:
                if node in s.members:
                    cost = self._cost(inst.info)
                    if len(s.members) > 1:  # a tensor-parallel group's member holds a slice
                        cost = cost.per_member(len(s.members))
                    out[inst.name] = Held(cost.stage_bytes(s.start, s.end), cost.kv_per_layer * (s.end - s.start))
        return out

    def room(self, instance: str, node: str) -> int | None:
        """What ``node``'s budget leaves ``instance`` for its weights and reserve beside the others."""
        budget = self.parts.cluster.info_of(node).budget
        return room_left(budget, self.held(node, frozenset({instance})).values())

    def kv_room(self, instance: str, node: str) -> int | None:
        """``instance``'s share of ``node``'s KV memory."""
        budget = self.parts.cluster.info_of(node).budget
        return kv_shares(budget, self.held(node)).get(instance, budget)

    def _make_room(self, name: str, info: ModelInfo) -> None:
        """Unload idle instances, least recently used first, until ``name`` fits; EngineError 503 if it
        cannot fit even then (a busy instance is never unloaded)."""
        cost = self._cost(info)
        members = self._members()

        def short(removed: frozenset[str]) -> str | None:
            nodes = [NodeSpec(n, "", room_left(i.budget, self.held(n, removed).values()), api_only=i.api_only) for n, i in sorted(members.items())]
            # It fits if the fewest Macs it would be placed over hold it (``_home``): a 2-layer
            # model on three Macs is placed on one or two, not refused for want of a layer each.
            if fewest_holding({s.node: s.budget for s in nodes if not s.api_only}, cost) is not None:
                return None
            return shortfall(nodes, cost)

        order = eviction_order(self._usages())
        gone = victims(order, lambda removed: short(removed) is None)
        if gone is None:
            why = short(frozenset(order))
            busy = [i.name or f"{i.model_id} (the configured model)" for i in self.instances.values() if i.name not in order]
            raise EngineError(
                f"model {name} does not fit the cluster's memory beside {', '.join(busy) or 'nothing'}: {why}", 503
            )  # fmt: skip
        for victim in gone:
            self.unload(victim, f"evicted (least recently used, idle) to make room for {name}")

    def replicas_of(self, name: str) -> list[Instance]:
        """The instances of the model ``name``, in replica order (the first, then #2, #3, ...)."""
        found = [i for i in self.instances.values() if same_model(i.model_id, name)]
        return sorted(found, key=lambda i: int(i.name.rsplit(REPLICA_MARK, 1)[1]) if REPLICA_MARK in i.name else 1)

    def nodes_for(self, instance: str) -> frozenset[str] | None:
        """The nodes ``instance`` may place its ring over: a replica's share (``sharing.regroup``:
        sticky, even, contiguous), or None (any) for a model with one instance."""
        inst = self.instances.get(instance)
        if inst is None:
            return None
        replicas = self.replicas_of(inst.model_id)
        key = tagged(inst.model_id)
        live = sorted((n for n, info in self._members().items() if not info.api_only), key=natural_key)
        if len(replicas) <= 1:
            self._groups.pop(key, None)
            return None if inst.pinned else self._home(inst, live)
        groups = self._groups[key] = regroup(self._groups.get(key, []), live, len(replicas))
        return groups[replicas.index(inst)]

    def _home(self, inst: Instance, live: list[str]) -> frozenset[str] | None:
        """The nodes of a model loaded on demand: the fewest that hold it, those with the most room
        first (``sharing.fewest_nodes``), kept while they live and still hold it."""
        cost = self._cost(inst.info)
        rooms = {n: self.room(inst.name, n) for n in live}
        home = self.homes.get(inst.name)
        if home is not None and home[0] <= set(live) and holds({n: rooms[n] for n in sorted(home[0])}, cost):
            return home[0]
        chosen = fewest_holding(rooms, cost)
        if chosen is None:
            self.homes.pop(inst.name, None)
            return None  # no set holds it: placement over all of them says by how much
        why = (
            f"on {chosen[0]} alone: it fits there, and no hop is the cheapest hop" if len(chosen) == 1
            else f"over {', '.join(chosen)}: the fewest Macs whose free memory holds it"
        )  # fmt: skip
        if home is None or home[0] != frozenset(chosen):
            log.info("placing %s %s", inst.name, why)
        self.homes[inst.name] = (frozenset(chosen), why)
        return frozenset(chosen)

    def unload(self, name: str, reason: str, force: bool = False) -> bool:
        """Unload the instance ``name`` (a pinned one, of the configured model, only with
        ``force``, and never the first); False if there is none."""
        inst = self.instances.get(name)
        if inst is None or not inst.name or (inst.pinned and not force):
            return False
        del self.instances[name]
        self.homes.pop(name, None)
        log.info("unloading %s: %s", name, reason)
        inst.coordinator.unload(f"model {name} was unloaded: {reason}")
        for c in self.coordinators():
            c.refresh_kv()
        return True

    def unload_model(self, model: str, reason: str) -> list[str]:
        """Every instance of ``model`` (its replicas too), as Ollama's keep_alive 0 does: an idle
        one now, one serving requests or loading for them once they are done (its keep_alive 0:
        the next keep_alive tick after its last request). The names that go."""
        going = []
        for usage in self._usages():
            inst = self.instances[usage.name]
            if not inst.name or inst.pinned or not same_model(inst.model_id, model):
                continue
            if usage.active:
                inst.keep_alive = 0.0
                log.info("unloading %s once its %s done: %s", inst.name, "load and requests are" if usage.active > inst.outstanding else "requests are", reason)
                going.append(inst.name)
            elif self.unload(inst.name, reason):
                going.append(inst.name)
        return going

    def _usages(self) -> list[Usage]:
        return [i.usage(loading=self.loads.busy(tagged(i.model_id))) for i in self.instances.values()]

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(KEEP_ALIVE_TICK_S)
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        """Unload the instances idle past their keep_alive at ``now`` (monotonic seconds)."""
        usages = self._usages()
        for usage in usages:
            if usage.active:
                self.instances[usage.name].last_used = now  # busy: its idle time starts when its last request ends
        # An instance busy now is never expired: the snapshot's last_used of the rest is current.
        for name in expired(usages, now):
            inst = self.instances[name]
            self.unload(name, f"idle for its keep_alive ({format_keep_alive(inst.keep_alive)})")

    def status(self) -> list[dict]:
        now = time.monotonic()
        rows = []
        for i in self.instances.values():
            home, replicas = self.homes.get(i.name), self.replicas_of(i.model_id)
            if home is not None:
                why = home[1]
            elif len(replicas) > 1:
                why = f"replica {replicas.index(i) + 1} of {len(replicas)}, over its share of the Macs"
            else:
                why = "over every Mac that may hold layers"
            rows.append(i.status(now) | {"placement": why})
        return rows
