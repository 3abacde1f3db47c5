"""This node's stage of one instance: take a plan from the leader, load the layers it gives us, run them.

A node hosts at most one stage of each of the leader's instances (``stages.py`` keeps
them: the configured model's, and one per model loaded on demand or replica). A PLAN from the leader the election follows
is taken (``reconcile.plan_refusal`` says which are not); the layers it gives
this node are loaded on the compute thread (the ones already loaded are kept
when the range is the same), and the answer goes back as LOADED. What this
node runs is its ``report``, which its heartbeats repeat: the leader reconciles
against it, so a LOADED lost with a broken link is not a wedge.

FORWARD and RELEASE frames go to the ``StageRunner``, but only from the node
that precedes this stage in the plan (the leader, for stage 0): a frame of
another ring, however it got here, never touches this ring's caches.

A stage that is a tensor-parallel group (``Stage.group``) is hosted by each member:
each loads its slice of the layers (``Shard.load`` with a ``TensorGroup``), the
group's first member relays every FORWARD and RELEASE to the others before it runs
it, so all apply the same frames in the same order, and only the first passes the
output on. The members' partial sums (REDUCE) go to the group; a member gone, stalled
or out of step breaks the stage, as a lost link does.

As a group forms (each plan), its members tell each other what they offer over it
(``groupengine``): where every member has RDMA, the group runs MLX's jaccl instead, in a
process of its own on each member (``groupproc``); this host then feeds that process
the frames and passes on what it sends, and kills it when the plan changes or the group
breaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

from ringd.cluster.election import Term
from ringd.ring.plan import MAX_GROUP, PlacementError, Plan
from ringd.cluster.reconcile import BROKEN, LOADED, LOADING, OUTSIDE, Report, failure_report, plan_refusal
from ringd.base.metrics import Metrics
from ringd.models.checkpoint import ModelInfo
from ringd.models.errors import ModelError, ModelFileError
from ringd.models.peers import Holder, PeerModel
from ringd.models.progress import LoadProgress
from ringd.models.vision import sees
from ringd.base.names import parse_hostport
from ringd.stage.compute import ComputeThread, Reading
from ringd.stage.groupengine import MLX_BACKEND, RINGD, Choice, EngineError, GroupSettings, Offer, choose
from ringd.stage.groupproc import GroupProcess, GroupProcessError, RemoteShard, backend_env, free_port, jaccl_available
from ringd.stage.runner import StageRunner
from ringd.stage.shard import Shard
from ringd.stage.vision import Vision
from ringd.stage.tensorgroup import AHEAD, GroupError, TensorGroup
from ringd.ring.steps import Failure, Partial, term_of
from wire.frames import Frame, FrameError, MsgType

log = logging.getLogger(__name__)

# A stage answers LOADED only once it has a link to the next stage: the leader
# starts sending requests at once. A peer on the LAN links in well under a
# second; this covers a dial loop in its backoff (DIAL_BACKOFF_MAX_S, 3 s)
# and a handshake (HANDSHAKE_TIMEOUT_S, 5 s).
SUCCESSOR_LINK_TIMEOUT_S = 10.0
# How long a forming group's members wait for each other's offers: a member still loading the
# last plan's layers (minutes, for a large model read from a slow disk) answers once it is done.
# A member that died is noticed sooner, by its link.
OFFERS_TIMEOUT_S = 600.0
# Partial sums held for a plan whose group has not formed here yet: a member may be AHEAD
# all-reduces ahead of this one (its offers), from each other member of the largest group.
MAX_EARLY_PARTIALS = AHEAD * MAX_GROUP


def plan_term(plan: Plan) -> Term:
    """A plan's name: the term its leader claimed for it."""
    return Term(plan.term, plan.leader)


@dataclasses.dataclass(frozen=True)
class StageSource:
    """The model a stage loads its layers of, as the node found it by the name a plan gives."""

    model: str  # a path or reference mlx-lm (or models/source.py) reads
    info: ModelInfo
    peer_model: PeerModel | None = None  # fetched from peers (model_from_peers): layers come from holders first


class StageOwner(Protocol):
    """What a stage host asks of the node it runs on."""

    def send(self, node: str, frame: Frame) -> None:
        """To ``node`` (this one too) over its link; raises ConnectionError if there is none."""

    def send_now(self, node: str, frame: Frame) -> bool:
        """From any thread: to ``node`` over its link at once; False for this node itself
        (``send``, on the event loop); raises ConnectionError if there is no link."""

    def lend(self, node: str, take: Callable[[Frame], bool], returned: Callable[[], None]) -> Reading | None:
        """The reading of ``node``'s link, lent to the compute thread: each frame it reads goes to
        ``take`` there; from the first it does not take, the link goes back to the event loop
        (its frames to ``on_frame``, in order) and ``returned`` is called there. None if it
        cannot be lent (no link, lent already, this node itself)."""

    def grouped(self) -> bool:
        """Whether a stage on this node is, or is loading to be, a tensor-parallel group's: its
        collectives wait on the compute thread for partial sums the event loop reads, so no
        link may be lent to that thread meanwhile."""

    def reported(self) -> None:
        """A stage's report changed: the leader reconciles against it."""

    def departed(self, node: str) -> bool:
        """Whether ``node`` said LEAVE: a link to it that drops breaks no ring."""

    def dial(self, host: str, port: int) -> None:
        """Keep a link to the next stage's node."""

    def holders(self, fingerprint: str) -> list[Holder]:
        """The linked peers that serve the files of the model ``fingerprint``."""

    async def resolve(self, plan: Plan) -> StageSource:
        """The model ``plan`` names (its ``source``, ``model`` its fingerprint), as this node holds
        it ("": the node's configured model), or fetched from the plan's leader."""

    def tokenizer_of(self, info: ModelInfo) -> Any:
        """The model's tokenizer (mlx-lm's TokenizerWrapper): the last stage follows grammars with it."""


class StageHost:
    def __init__(self, node: str, instance: str, owner: StageOwner, compute: ComputeThread, metrics: Metrics, settings: GroupSettings = GroupSettings()):
        self.node = node
        self.settings = settings  # what this node offers a tensor-parallel group
        # Which of the leader's instances this stage is of ("": the configured model's). Its model
        # is found by the name its plan gives (``owner.resolve``) at its first load, and checked
        # against the plan's fingerprint.
        self.instance = instance
        self._owner = owner
        self.source: StageSource | None = None  # the model, once a plan named it
        self.metrics = metrics
        self.stopping = False
        self.compute = compute
        self.plan: Plan | None = None  # the plan taken last
        self.shard: Shard | RemoteShard | None = None
        self.vision: Vision | None = None  # a model that sees, on its first stage: its vision tower
        self.stage: StageRunner | GroupProcess | None = None
        self.group: TensorGroup | None = None  # the tensor-parallel group the shard is a slice for
        self.engine: Choice | None = None  # what the group runs on, as its members chose
        self.process: GroupProcess | None = None  # the group's process here, where it runs an MLX backend
        self.report = Report()
        self.progress: LoadProgress | None = None  # the load under way, for status(); None when not loading
        # Why a file of the model cannot be read, once a load found it (truncated, corrupt): the
        # same bytes give the same error, so no later plan reads them again until a restart.
        self.unreadable: str | None = None
        self._lock = asyncio.Lock()  # one load at a time, in the order plans were taken
        self._ring_links: dict[str, int] = {}  # ring neighbour -> the number of our link to it, once seen
        self._links: dict[str, int] = {}  # linked peers -> link numbers, as of the last check_links
        self._links_changed = asyncio.Event()
        self._early: list[tuple[int, str, Frame]] = []  # (term, peer, REDUCE) before their group formed here
        # The link from the node before this stage, while the compute thread reads it (``_read_here``).
        self._reading: Reading | None = None
        self._reading_from: str | None = None
        self._loads: set[asyncio.Task] = set()  # ``load`` calls under way or waiting: stop() ends them

    @property
    def loading(self) -> bool:
        return self.report.state == LOADING

    @property
    def grouped(self) -> bool:
        """Whether the plan taken last makes this node a member of a tensor-parallel group."""
        i = self.plan.index_of(self.node) if self.plan is not None else None
        return i is not None and len(self.plan.stages[i].members) > 1

    def take(self, sender: str, d: dict, leader: str | None) -> Plan | None:
        """A PLAN frame: the plan to load (then call ``load``), or None if it is not for us to take."""
        try:
            plan = Plan.from_wire(d)
        except PlacementError as e:
            log.warning("ignoring a malformed plan from %s: %s", sender, e)
            return None
        term = plan_term(plan)
        current = plan_term(self.plan) if self.plan is not None else None
        why = plan_refusal(term, sender, leader, current)
        if why is not None:
            log.warning("ignoring plan term %d from %s: %s", plan.term, sender, why)
            return None
        if current == term:  # a resend: answer again what we answered
            if self.report.plan == term and self.report.state != LOADING:
                self._answer(plan)
            return None
        self.plan = plan
        self._ring_links = {}
        if self.process is not None:  # MLX's group cannot take a new plan: the next load starts another
            self.process.kill()
        if plan.index_of(self.node) is None:
            self._set(Report(term, OUTSIDE))
        else:
            self._set(Report(term, LOADING))
        return plan

    async def load(self, plan: Plan) -> None:
        """Bring this node's stage to ``plan`` and answer the leader; plans are loaded in the order
        taken. Given up (cancelled) if the stage is stopped meanwhile: the leader unloaded it, or
        the node stops; layers it read are let go, not kept by a stage nobody holds."""
        task = asyncio.current_task()
        self._loads.add(task)
        try:
            await self._load_in_turn(plan)
        finally:
            self._loads.discard(task)

    async def _load_in_turn(self, plan: Plan) -> None:
        async with self._lock:
            if self.plan is not plan:
                return  # overtaken by a later plan while waiting
            term = plan_term(plan)
            try:
                await self._load(plan)
            except ModelError as e:  # the message says what is wrong; a traceback adds nothing to it
                if not isinstance(e, ModelFileError):
                    log.error("could not load plan term %d: %s", plan.term, e)
                elif self.unreadable is None:  # said once; later plans are refused with it, unread
                    self.unreadable = str(e)
                    log.error("could not load plan term %d: %s; this node loads no layers until the file is fixed and the node restarted", plan.term, e)
                if self.plan is plan:
                    self._set(failure_report(term, str(e)))
            except Exception as e:  # a load failure is reported to the leader; the node stays up
                log.exception("could not load plan term %d", plan.term)
                if self.plan is plan:
                    self._set(failure_report(term, f"{type(e).__name__}: {e}"))
            else:
                if self.plan is plan:
                    holds = plan.index_of(self.node) is not None
                    self._set(Report(term, LOADED, kv=self.shard.kv_cost) if holds else Report(term, OUTSIDE))
            if self.plan is plan:
                self._answer(plan)

    def _answer(self, plan: Plan) -> None:
        try:
            self._owner.send(plan.leader, Frame(MsgType.LOADED, 0, self.report.to_wire()))
        except ConnectionError as e:
            if self._owner.departed(plan.leader):
                log.debug("not answering plan term %d: its leader %s is leaving", plan.term, plan.leader)
                return
            log.warning("could not answer plan term %d (its heartbeat will): %s", plan.term, e)

    def _set(self, report: Report) -> None:
        self.report = dataclasses.replace(report, instance=self.instance) if self.instance else report
        self._owner.reported()

    async def _load(self, plan: Plan) -> None:
        if self.stage is not None:
            self.stage.close()
            self.stage = None
        if self.group is not None:  # whatever the last plan's compute waits for is given up
            self.group.abort(f"plan term {plan.term} replaces term {self.group.term}", logging.DEBUG)
        if self.process is not None:
            await self._end_process()
        i = plan.index_of(self.node)
        if self.instance and i is None:
            self.shard = self.vision = self.group = self.engine = None
            return
        # The configured model's is resolved once; another instance's again when a plan names
        # another model (its stage is kept while the leader's instance of that name lives).
        if self.source is None or (self.instance and plan.model != self.source.info.fingerprint):
            self.shard = self.vision = None
            self.source = await self._owner.resolve(plan)
        source = self.source
        if plan.model != source.info.fingerprint:
            raise ModelError(
                f"the leader serves model {plan.model}, this node has {source.info.fingerprint} "
                f"({source.model}); every node needs the same model"
            )
        if i is None:
            self.shard = self.group = self.engine = None
            return
        want = plan.stages[i]
        members = want.members
        same_group = (self.group.members if self.group else (self.node,)) == members
        if len(members) > 1:
            await self._link_to([(n, a) for n, a in ((want.node, want.addr), *want.group) if n != self.node], plan)
            if same_group and self.group is not None:
                await self.compute.run(self.group.reset, plan.term)  # after the last plan's queued work
            else:
                self.group = self._group(plan.term, members)
            early, self._early = [e for e in self._early if e[0] == plan.term], []
            for _, peer, frame in early:
                self.group.arrive(peer, frame)
            self.engine = await self._choose_engine(plan, want)
        else:
            self.group = self.engine = None
        first = want.node == self.node
        if self.engine is not None and self.engine.in_process:
            await self._load_process(plan, want, source, first)
        else:
            await self._load_here(plan, want, source, same_group and not isinstance(self.shard, RemoteShard))
            # A group's other members compute as its first does, but only the first passes frames on.
            self.stage = StageRunner(
                self.node, plan, self.shard, self.compute, self._pass_on if first else self._drop, self.metrics, self._grammar_tokenizer(),
                self._pass_on_now if first else None, self.vision,
            )  # fmt: skip
        successor = plan.successor(self.node)
        if successor is not None and first:
            await self._link_to([(successor.node, successor.addr)], plan, "the next stage")

    async def _load_here(self, plan: Plan, want, source: StageSource, keep: bool) -> None:
        """This node's layers (its slice, in a group on the ringd engine) loaded in the daemon;
        the layers already loaded are kept when the range and group are the same (``keep``)."""
        if keep and self.shard is not None and (self.shard.start, self.shard.end) == (want.start, want.end):
            return
        self.shard = self.vision = None  # free the old layers before loading new ones
        if self.unreadable is not None:
            raise ModelFileError(self.unreadable)
        t0 = time.monotonic()
        progress = self.progress = LoadProgress(want.start, want.end)
        try:
            if source.peer_model is not None:
                holders = self._owner.holders(plan.model)
                await source.peer_model.ensure(want.start, want.end, source.info.num_layers, holders, progress)
            self.shard = await self.compute.run(Shard.load, source.model, want.start, want.end, progress, self.group)
        except asyncio.CancelledError:
            # The node is stopping: the compute thread gives the load up at its next step
            # (a download's next chunk) instead of finishing many GB nobody will use.
            progress.cancel()
            raise
        finally:
            self.progress = None
        log.info(
            "loaded layers [%d, %d) in %.1f s: %.1f MiB of parameters",
            want.start, want.end, time.monotonic() - t0, self.shard.parameter_bytes / 2**20,
        )  # fmt: skip
        if self.shard.is_first and sees(self.shard.info):
            # Where the ring starts, a model that sees runs its vision tower; without it, requests
            # with images fail as they open (saying why) and the rest are served.
            try:
                self.vision = await self.compute.run(Vision.load, self.shard.info, self.shard)
            except ModelError as e:
                log.warning("images cannot be seen on this node: %s", e)

    async def _choose_engine(self, plan: Plan, want) -> Choice:
        """The group's engine: every member's offer, gathered over the ringd engine (as the
        group's first all-gather of this plan), read the same way by each (``groupengine``)."""
        group = self.group
        host = parse_hostport(want.addr if want.node == self.node else dict(want.group)[self.node])[0]
        try:
            addr = f"{host}:{free_port(host)}" if self.settings.wanted != RINGD else ""
        except OSError as e:  # an advertised address this Mac cannot listen on: no group process here
            log.warning("tensor-parallel group %s: no port for a group process on %s: %s", "+".join(group.members), host, e)
            addr = ""
        mine = Offer(self.node, self.settings.wanted, jaccl_available(), self.settings.rdma, addr)
        try:
            raws = await self.compute.run(group.gather_bytes, mine.to_bytes(), OFFERS_TIMEOUT_S)
            choice = choose([Offer.from_bytes(raw, node) for raw, node in zip(raws, group.members)])
        except (GroupError, EngineError) as e:
            raise ModelError(f"tensor-parallel group {'+'.join(group.members)}: {e}") from None
        log.log(logging.INFO if choice.in_process else logging.DEBUG, "tensor-parallel group %s runs on %s: %s", "+".join(group.members), choice.engine, choice.why)
        return choice

    async def _load_process(self, plan: Plan, want, source: StageSource, first: bool) -> None:
        """This node's slice loaded and run by a group process of MLX's backend (``groupproc``)."""
        self.shard = self.vision = None  # the daemon holds no layers of this stage; the process does
        if self.unreadable is not None:
            raise ModelFileError(self.unreadable)
        if source.peer_model is not None:
            await source.peer_model.ensure(want.start, want.end, source.info.num_layers, self._owner.holders(plan.model), LoadProgress(want.start, want.end))
        rank, engine = self.group.rank(), self.engine
        env, files = backend_env(engine, rank)
        env |= {"RINGD_GROUP_NODE": self.node, "RINGD_LOG_LEVEL": logging.getLevelName(logging.getLogger().level).lower()}
        spec = {"node": self.node, "plan": plan.to_wire(), "model": source.model, "start": want.start, "end": want.end, "backend": MLX_BACKEND[engine.engine]}
        t0 = time.monotonic()
        try:
            process = self.process = await GroupProcess.start(plan, self.node, spec, env)
            process.on_send = self._pass_on if first else self._drop
            process.on_exit = lambda why: self._process_ended(process, why)
            self.shard = await process.loaded()
        except GroupProcessError as e:
            await self._end_process()
            raise (ModelFileError if e.file_fault else ModelError)(f"the group process ({engine.engine}): {e}") from None
        finally:
            for f in files:
                f.unlink(missing_ok=True)
        self.stage = process
        log.info(
            "group process %d (%s, rank %d of %d) loaded layers [%d, %d) in %.1f s: %.1f MiB of parameters",
            process.pid, engine.engine, rank, self.group.size(), want.start, want.end, time.monotonic() - t0, self.shard.parameter_bytes / 2**20,
        )  # fmt: skip

    async def _end_process(self) -> None:
        process, self.process = self.process, None
        if self.stage is process:
            self.stage = None
        if process is not None:
            await process.stop()

    def _process_ended(self, process: GroupProcess, why: str) -> None:
        if process is self.process and self.stage is process:
            self._broken(f"its group process ended: {why}")

    async def _link_to(self, nodes: list[tuple[str, str]], plan: Plan, what: str = "a member of this stage's group") -> None:
        """Links to ``nodes`` (node, addr), dialed where there are none, within SUCCESSOR_LINK_TIMEOUT_S."""
        for node, addr in nodes:
            if node in self._links:
                continue
            try:
                self._owner.dial(*parse_hostport(addr))
            except ValueError:
                raise ModelError(f"plan term {plan.term} gives {node} an address we cannot dial: {addr!r}") from None
        try:
            async with asyncio.timeout(SUCCESSOR_LINK_TIMEOUT_S):
                while missing := [(n, a) for n, a in nodes if n not in self._links]:
                    self._links_changed.clear()
                    await self._links_changed.wait()
        except TimeoutError:
            n, a = missing[0]
            raise ConnectionError(f"no link to {what} {n} at {a} within {SUCCESSOR_LINK_TIMEOUT_S:.0f} s") from None

    def _group(self, term: int, members: tuple[str, ...]) -> TensorGroup:
        """This node's place in a tensor-parallel group; when it breaks, the stage is broken."""
        loop = asyncio.get_running_loop()
        group = TensorGroup(term, members, members.index(self.node), self._owner.send, loop)
        group.on_break = lambda why: loop.call_soon_threadsafe(self._group_broke, group, why)
        group.timed = self.metrics.all_reduce.observe
        return group

    def _group_broke(self, group: TensorGroup, why: str) -> None:
        if group is self.group and self.plan is not None and group.term == self.plan.term:
            self._broken(f"its tensor-parallel group broke: {why}")

    def _drop(self, node: str, frame: Frame) -> None:
        """A group member's output: its first member sends the same."""

    def _grammar_tokenizer(self) -> Callable[[], Any]:
        """llguidance's tokenizer, built by the first request with a grammar (on the compute
        thread) and kept with the tokenizer, so nodes that never see a grammar never build it."""
        owner, info, vocab_size = self._owner, self.source.info, self.shard.info.vocab_size

        def build():
            from ringd.stage import grammar  # llguidance: loaded by the first request with a grammar

            return grammar.ll_tokenizer(owner.tokenizer_of(info), vocab_size)

        return build

    def stop(self) -> None:
        """The node is stopping: its stage takes no more steps, and what it can no longer pass on
        breaks no ring (the leader plans without this node)."""
        self.stopping = True
        for task in self._loads:
            task.cancel()
        if self._reading is not None:
            self._reading.ask_back()
        if self.stage is not None:
            self.stage.close()
        if self.group is not None:
            self.group.abort("this node stops", logging.DEBUG)
        if self.process is not None:
            self.process.kill()

    def _pass_on(self, node: str, frame: Frame) -> None:
        """The stage's output, to the next stage or the leader. A frame that cannot go breaks the ring."""
        try:
            self._owner.send(node, frame)
        except ConnectionError as e:
            if self.stopping or self._owner.departed(node):
                who = "this node stops" if self.stopping else f"{node} is leaving"
                log.debug("%x: not passed on to %s as %s: %s", frame.request_id, node, who, e)
                return
            log.warning("%s=%x: cannot pass %s on to %s: %s", "req" if frame.type == MsgType.RELEASE else "batch", frame.request_id, frame.type.name, node, e)
            self._broken(f"could not pass a frame on to {node}")

    def _pass_on_now(self, node: str, frame: Frame) -> bool:
        """From the compute thread: the stage's output over ``node``'s link at once, with no hop
        through the event loop. False where it must take that hop: to this node itself, or over
        a link that failed (``_pass_on`` tries it there, and says what happened)."""
        if self.stopping:
            return False
        try:
            return self._owner.send_now(node, frame)
        except ConnectionError:
            return False

    def _read_here(self) -> None:
        """On the event loop: a loaded stage's link from the node before it is read on the compute
        thread, which computes each FORWARD and RELEASE of the stage's plan as it reads it and
        sends the output on (``_take_now``): a hop wakes no event loop. Anything else it reads
        (a heartbeat, a plan, a frame of another plan) goes back to the loop with the link, in
        order, and the link is lent again after. Not while any stage on this node is a
        tensor-parallel group's (its first member relays each frame on the loop, and a
        collective waits on the compute thread for what the loop reads)."""
        stage = self.stage
        ok = isinstance(stage, StageRunner) and self.group is None and self.report.state == LOADED and not self.stopping
        want = stage.predecessor if ok and not self._owner.grouped() else None
        if self._reading is not None:
            if self._reading_from != want:
                self._reading.ask_back()  # another predecessor now: lent again once back
            return
        if want is not None and want != self.node:
            self._reading = self._owner.lend(want, self._take_now, self._read_back)
            self._reading_from = want if self._reading is not None else None

    def _read_back(self) -> None:
        """On the event loop: the compute thread gave the link back (the loop has handled what it
        did not take)."""
        self._reading = self._reading_from = None
        self._read_here()

    def _take_now(self, frame: Frame) -> bool:
        """On the compute thread: a frame the lent link brought, computed here at once if the loop
        would have handed it to this stage (``on_frame``); False leaves it to the loop."""
        stage = self.stage
        if (
            frame.type not in (MsgType.FORWARD, MsgType.RELEASE, MsgType.MEDIA)
            or not isinstance(stage, StageRunner)
            or self.stopping
            or self.group is not None
            or self.report.state != LOADED
            or stage.predecessor != self._reading_from
            or term_of(frame) != stage.plan.term
        ):
            return False
        stage.apply(frame)
        return True

    def check_links(self, links: dict[str, int]) -> None:
        """Links changed (node -> link number): a loaded stage whose link to a ring neighbour
        dropped or was re-made may have lost frames, and says so (``reconcile.BROKEN``)."""
        self._links = dict(links)
        self._links_changed.set()
        self._read_here()
        plan, stage = self.plan, self.stage
        if stage is None or plan is None or self.report.state != LOADED:
            return
        group = self.group.members if self.group is not None else ()
        # A group's other members send nothing on: their ring neighbours are the group's first and the rest.
        onward = stage.next_node if not group or group[0] == self.node else None
        for n in {stage.predecessor, onward, *group} - {None, self.node}:
            if n in links and n not in self._ring_links:
                self._ring_links[n] = links[n]
            elif n in self._ring_links and links.get(n) != self._ring_links[n]:
                if n not in links and self._owner.departed(n):
                    continue  # it left: the leader re-plans without it
                why = f"the link to {n} {'was re-made' if n in links else 'dropped'}"
                if self.group is not None and n in group:
                    self.group.abort(why)  # an all-reduce waiting for it gives up now
                    if self.process is not None:  # and MLX's, which waits for nothing else
                        self.process.kill()
                self._broken(why)
                return

    def _broken(self, why: str) -> None:
        plan = self.plan
        if plan is None or self.report.state != LOADED or self.stopping:
            return
        log.warning("ring of plan term %d broken here: %s; telling %s", plan.term, why, plan.leader)
        self._set(Report(plan_term(plan), BROKEN, why))
        self._answer(plan)

    def forget(self) -> None:
        """Drop the stage (the node is stopping, or the leader that gave it is gone for good)."""
        if self.stage is not None:
            self.stage.close()
        if self.group is not None:
            self.group.abort("the stage is dropped", logging.DEBUG)
        if self.process is not None:
            self.process.kill()
        self.stage, self.shard, self.plan, self.group, self.process = None, None, None, None, None
        self._set(Report())

    def on_frame(self, peer: str, frame: Frame) -> None:
        """FORWARD or RELEASE: to the stage, if it came from the node before ours in the ring."""
        stage = self.stage
        if stage is None:
            if frame.type == MsgType.FORWARD:
                self._owner.send(peer, Failure(frame.request_id, term_of(frame), self.node, "no stage loaded here", 503).frame())
            return
        if peer != stage.predecessor:
            log.warning(
                "%x: ignoring %s from %s: in plan term %d this stage hears only from %s",
                frame.request_id, frame.type.name, peer, stage.plan.term, stage.predecessor,
            )  # fmt: skip
            return
        if self.group is not None and self.node == self.group.members[0]:
            for member in self.group.members[1:]:  # the group's first relays: all apply the same frames in order
                try:
                    self._owner.send(member, frame)
                except ConnectionError as e:
                    self.group.abort(f"cannot relay a frame to {member}: {e}")
        stage.handle(frame)

    def on_reduce(self, peer: str, frame: Frame) -> None:
        """A partial sum from a member of this stage's tensor-parallel group. One of a plan whose
        group is not formed here yet (another member took the plan first and sent its offer) is
        held until it is (``_early``), for the newest such plan only."""
        group = self.group
        try:
            term = Partial.parse(frame).term
        except FrameError:
            term = None  # the group says what is wrong with it
        if group is not None and (term is None or term == group.term):
            group.arrive(peer, frame)
        elif term is not None and (self.plan is None or term >= self.plan.term):
            if self._early and self._early[0][0] < term:
                self._early.clear()
            if (not self._early or self._early[0][0] == term) and len(self._early) < MAX_EARLY_PARTIALS:
                self._early.append((term, peer, frame))
        elif group is not None:
            group.arrive(peer, frame)  # of an older plan: the group ignores it

    def status(self) -> dict:
        stage = self.stage
        return {
            "stage": self.plan.index_of(self.node) if self.plan else None,
            # A tensor-parallel group's collective (groupengine): ringd, or an MLX backend in a group process.
            "engine": self.engine.engine if self.engine else None,
            "layers": [self.shard.start, self.shard.end] if stage and self.shard else None,
            "sessions": len(stage.sessions) if stage else 0,
            "kv_bytes": stage.sessions.kv_bytes if stage else 0,
            "parameter_bytes": self.shard.parameter_bytes if self.shard else 0,
            "prefix_entries": stage.sessions.stored if stage else 0,
            # What a request's caches cost here, measured from this stage's own caches at load.
            "kv_cost": self.shard.kv_cost.to_wire() if self.shard else None,
            "report": self.report.to_wire(),
            # While this node downloads or reads its layers: how far (progress.py), else None.
            "progress": self.progress.to_wire() if self.progress is not None else None,
        }
