"""ringd.cluster.reconcile: the rules one case at a time, then a simulated cluster under Hypothesis.

The simulator is a cluster of nodes each running the real ``Election`` and
``Reconciler`` and the follower's real ``plan_refusal`` and
``follower_readiness``, in rounds of one heartbeat interval. What it stands in
for is only what those sans-I/O parts leave to the daemon: links (numbered,
FIFO, lost with everything queued on them when they drop), heartbeats that
carry each node's election state and report, a failure detector that closes a
link silent for ``DEAD_AFTER_ROUNDS``, dial loops that re-make links, and
loading that takes a few rounds. Faults are stalls (a node does nothing for a
while: a Mac asleep, a SIGSTOP, a blocked event loop), dropped links re-made at
once, partitions, heals and pins that move the leader.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.cluster.election import Election, Term, rank
from ringd.base.names import natural_key
from ringd.cluster.reconcile import (
    BROKEN,
    FAILED,
    IDLE,
    LOADED,
    LOADING,
    MAX_ERROR_CHARS,
    OUTSIDE,
    PLAN_DELIVERY_BEATS,
    RETRY_AFTER_FAILURE_S,
    Member,
    Reconciler,
    Report,
    ReportError,
    failure_report,
    follower_readiness,
    plan_refusal,
)

from ringd.cluster.links import HEARTBEAT_INTERVAL_S

# How long a plan may take to be heard of, with the default heartbeat.
PLAN_DELIVERY_TIMEOUT_S = PLAN_DELIVERY_BEATS * HEARTBEAT_INTERVAL_S

T = Term


def loaded(term: Term) -> Report:
    return Report(term, LOADED)


# --- the rules, one case at a time -----------------------------------------------------


def test_first_plan_then_ready_once_every_stage_loaded():
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {"a": Member(0, True), "b": Member(7, True)}
    assert r.tick(0.0, members, hold="discovering nodes").reason == "discovering nodes"
    d = r.tick(0.0, members)
    assert d.plan_over == ("a", "b") and not d.ready
    r.planned(0.0, T(3, "a"), ("a", "b"), d.plan_over, members)
    d = r.tick(0.1, {"a": Member(0, True, Report(T(3, "a"), LOADING)), "b": Member(7, True)})
    assert d.plan_over is None and not d.ready and "waiting for a, b" in d.reason
    d = r.tick(0.2, {"a": Member(0, True, loaded(T(3, "a"))), "b": Member(7, True, loaded(T(3, "a")))})
    assert d.ready and d.plan_over is None


def test_a_relinked_stage_means_a_fresh_plan_even_with_the_same_members():
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {"a": Member(0, True, loaded(T(3, "a"))), "b": Member(7, True, loaded(T(3, "a")))}
    r.planned(0.0, T(3, "a"), ("a", "b"), ("a", "b"), members)
    assert r.tick(1.0, members).ready
    relinked = {**members, "b": Member(8, True, loaded(T(3, "a")))}
    d = r.tick(1.5, relinked)
    assert d.plan_over == ("a", "b") and "re-made" in d.reason


def test_a_stage_that_lost_a_ring_link_means_a_fresh_plan():
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {n: Member(i, True, loaded(T(3, "a"))) for i, n in enumerate("abc")}
    r.planned(0.0, T(3, "a"), ("a", "b", "c"), ("a", "b", "c"), members)
    assert r.tick(0.5, members).ready
    broken = {**members, "b": Member(1, True, Report(T(3, "a"), BROKEN, "link to c re-made"))}
    d = r.tick(0.6, broken)
    assert d.plan_over == ("a", "b", "c") and "node b lost a link of the ring (link to c re-made)" in d.reason


def test_a_stage_on_another_leaders_plan_is_noticed_after_the_delivery_timeout():
    # The wedge of issue 7: the stalled leader comes back to the same members,
    # which meanwhile took another leader's plan.
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {"a": Member(0, True, loaded(T(5, "a"))), "b": Member(2, True, loaded(T(4, "b")))}
    r.planned(0.0, T(5, "a"), ("a", "b"), ("a", "b"), members)
    assert r.tick(PLAN_DELIVERY_TIMEOUT_S / 2, members).plan_over is None  # the plan may be in flight
    d = r.tick(PLAN_DELIVERY_TIMEOUT_S, members)
    assert d.plan_over == ("a", "b") and "does not run plan term 5 (it reports plan 4 of b)" in d.reason


def test_members_joining_leaving_and_drained():
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {"a": Member(0, True, loaded(T(1, "a"))), "b": Member(1, True, loaded(T(1, "a")))}
    r.planned(0.0, T(1, "a"), ("a", "b"), ("a", "b"), members)
    d = r.tick(0.5, {**members, "c": Member(2, True)})
    assert d.plan_over == ("a", "b", "c") and "c joined" in d.reason
    # Drained (holder=False): a plan without it, and it is told of the plan until it takes it.
    d = r.tick(0.5, {**members, "b": Member(1, False, loaded(T(1, "a")))})
    assert d.plan_over == ("a",) and "b left or drained" in d.reason
    r.planned(0.6, T(2, "a"), ("a",), ("a",), members)
    outside = {"a": Member(0, True, loaded(T(2, "a"))), "b": Member(1, False, loaded(T(1, "a")))}
    assert r.tick(0.7, outside) == r.tick(0.7, outside)  # idempotent
    assert r.tick(0.7, outside).ready and r.tick(0.7, outside).inform == ()  # told when planned
    assert r.tick(0.6 + PLAN_DELIVERY_TIMEOUT_S, outside).inform == ("b",)  # told again
    assert r.tick(0.6 + PLAN_DELIVERY_TIMEOUT_S, outside).inform == ()  # not every tick
    done = {**outside, "b": Member(1, False, Report(T(2, "a"), OUTSIDE))}
    assert r.tick(100.0, done).inform == () and r.tick(100.0, done).ready
    assert r.tick(100.0, {"a": Member(0, True, loaded(T(2, "a")))}).ready  # it may leave freely


def test_load_failures_and_placement_failures_are_retried_later_not_in_a_loop():
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {"a": Member(0, True, loaded(T(1, "a"))), "b": Member(1, True, failure_report(T(1, "a"), "x" * 1000))}
    r.planned(0.0, T(1, "a"), ("a", "b"), ("a", "b"), members)
    d = r.tick(1.0, members)
    assert not d.ready and d.plan_over is None and "node b could not load its layers: xxx" in d.reason
    assert len(members["b"].report.error) == MAX_ERROR_CHARS
    assert r.tick(RETRY_AFTER_FAILURE_S, members).plan_over == ("a", "b")
    r.placement_failed(31.0, ("a", "b"), "the model does not fit: short by 3 GiB")
    d = r.tick(32.0, members)
    assert d.plan_over is None and d.reason == "the model does not fit: short by 3 GiB"
    assert r.tick(32.0, {**members, "c": Member(2, True)}).plan_over == ("a", "b", "c")  # new members: try now
    assert r.tick(31.0 + RETRY_AFTER_FAILURE_S, members).plan_over == ("a", "b")


def test_plans_must_be_newer_and_made_under_this_leaders_terms():
    r = Reconciler("a", HEARTBEAT_INTERVAL_S)
    members = {"a": Member(0, True)}
    r.planned(0.0, T(2, "a"), ("a",), ("a",), members)
    with pytest.raises(ValueError, match="not newer"):
        r.planned(1.0, T(2, "a"), ("a",), ("a",), members)
    with pytest.raises(ValueError, match="another node"):
        r.planned(1.0, T(9, "b"), ("a",), ("a",), members)
    r.reset()
    assert r.term is None and r.tick(0.0, {"a": Member(0, False)}).reason.startswith("no live node may hold")


def test_plan_refusal():
    assert plan_refusal(T(4, "a"), "a", "a", None) is None
    assert plan_refusal(T(4, "a"), "a", "a", T(4, "a")) is None  # a resend
    assert plan_refusal(T(4, "a"), "a", "a", T(3, "b")) is None
    assert plan_refusal(T(4, "a"), "a", "a", T(5, "b")) is None  # another leader's: not ours to order
    assert "older" in plan_refusal(T(4, "a"), "a", "a", T(5, "a"))
    assert "the leader here is b" in plan_refusal(T(4, "a"), "a", "b", None)
    assert "not yet elected" in plan_refusal(T(4, "a"), "a", None, None)
    assert "came from c" in plan_refusal(T(4, "a"), "c", "c", None)


def test_follower_readiness():
    t = T(4, "a")
    assert follower_readiness("a", True, t, "", loaded(t)) == (True, "")
    assert follower_readiness("a", True, t, "", Report(t, OUTSIDE)) == (True, "")
    assert "election" in follower_readiness(None, False, None, "", Report())[1]
    assert "no link" in follower_readiness("a", False, t, "", loaded(t))[1]
    assert "does not serve: loading" in follower_readiness("a", True, None, "loading", loaded(t))[1]
    assert "has not taken plan term 4" in follower_readiness("a", True, t, "", loaded(T(3, "a")))[1]
    assert "still loading its layers" in follower_readiness("a", True, t, "", Report(t, LOADING))[1]
    assert "lost a link" in follower_readiness("a", True, t, "", Report(t, BROKEN, "link to b"))[1]
    assert "has not taken" in follower_readiness("a", True, t, "", loaded(T(5, "b")))[1]


reports = st.builds(
    Report,
    st.none() | st.builds(Term, st.integers(1, 2**53 - 1), st.sampled_from(["a", "node-2", "x.y"])),
    st.sampled_from([IDLE, LOADING, LOADED, FAILED, OUTSIDE]),
    st.none() | st.text(max_size=MAX_ERROR_CHARS),
)


@given(st.data())
def test_reports_round_trip_and_anything_else_is_a_report_error(data):
    try:
        report = data.draw(reports)
    except ReportError:
        return  # an inconsistent combination the strategy drew: refused at construction
    assert Report.from_wire(report.to_wire()) == report
    doc = data.draw(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["plan", "state", "error", "x"]), inner, max_size=4),
            max_leaves=10,
        )
    )
    try:
        Report.from_wire(doc)
    except ReportError:
        pass


# --- the simulated cluster -----------------------------------------------------------------

ROUND_S = 0.5  # one heartbeat interval
DEAD_AFTER_ROUNDS = 4  # dead_after_s 2.0 / heartbeat 0.5
# Once the faults stop: rounds until every live node serves one plan. Worst case,
# a quiet wrong plan is noticed only after PLAN_DELIVERY_TIMEOUT_S, and the
# elections the heal sets off come first: a generous bound that still catches
# a cluster that never settles.
SETTLE_ROUNDS = 4 * int(PLAN_DELIVERY_TIMEOUT_S / ROUND_S) + 20


@dataclass
class Node:
    name: str
    priority: int
    holder: bool
    election: Election
    reconciler: Reconciler
    plan: tuple[Term, tuple[str, ...]] | None = None  # the plan taken (follower side, leaders too)
    report: Report = field(default_factory=Report)
    loaded_at: int = 0  # round at which loading ends
    stalled_until: int = -1
    reports: dict[str, Report] = field(default_factory=dict)  # what each peer last said
    serving: dict[str, Term | None] = field(default_factory=dict)  # what each peer says it serves
    view: dict[str, int] = field(default_factory=dict)  # peer -> link number, as this node last saw
    heard: dict[str, int] = field(default_factory=dict)  # peer -> round last heard from
    ready: Term | None = None  # the plan this node serves, as leader
    ring_links: dict[str, int] = field(default_factory=dict)  # neighbour in the ring -> link number, once seen


class Sim:
    def __init__(self, nodes: dict[str, tuple[int, bool]], rng: random.Random):
        self.rng = rng
        self.nodes = {n: Node(n, p, h, Election(n, p), Reconciler(n, HEARTBEAT_INTERVAL_S)) for n, (p, h) in nodes.items()}
        self.round = 0
        self.links: dict[frozenset, int] = {}  # up links and their numbers
        self.queues: dict[tuple[str, str], deque] = defaultdict(deque)
        self.side = dict.fromkeys(nodes, 0)
        self._numbers = iter(range(1, 10**9))
        self.plans: dict[Term, tuple[str, ...]] = {}  # every plan ever made
        self.terms: dict[str, Term] = {}

    # faults

    def stall(self, node: str, rounds: int) -> None:
        self.nodes[node].stalled_until = self.round + rounds

    def drop(self, a: str, b: str) -> None:
        self._down(frozenset((a, b)))

    def partition(self, sides: list[bool]) -> None:
        self.side = {n: int(s) for n, s in zip(self.nodes, sides)}
        for link in [k for k in self.links if len({self.side[n] for n in k}) > 1]:
            self._down(link)

    def heal(self) -> None:
        self.side = dict.fromkeys(self.nodes, 0)

    def pin(self, at: str, target: str | None) -> None:
        node = self.nodes[at]
        if self.active(node):
            self.fan_out(node, node.election.set_pin(node.election.pin.next(target)))

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            self.step()

    # one heartbeat interval

    def active(self, node: Node) -> bool:
        return node.stalled_until < self.round

    def _down(self, link: frozenset) -> None:
        number = self.links.pop(link, None)
        if number is not None:
            a, b = sorted(link)
            self.queues.pop((a, b), None)
            self.queues.pop((b, a), None)

    def step(self) -> None:
        self.round += 1
        names = list(self.nodes)
        # Dial loops: live pairs on one side of any partition link up, not always at once.
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                link = frozenset((a, b))
                both = self.active(self.nodes[a]) and self.active(self.nodes[b])
                if link not in self.links and both and self.side[a] == self.side[b] and self.rng.random() < 0.7:
                    self.links[link] = next(self._numbers)
        self.rng.shuffle(names)
        for name in names:
            node = self.nodes[name]
            if self.active(node):
                self.act(node)
        self.check()

    def act(self, node: Node) -> None:
        now = self.round * ROUND_S
        # Failure detector: a linked peer silent too long is closed (as a closed socket would be at once).
        for peer in list(node.view):
            link = frozenset((node.name, peer))
            if link in self.links and self.links[link] == node.view[peer]:
                if self.round - node.heard.get(peer, self.round) > DEAD_AFTER_ROUNDS:
                    self._down(link)
        view = {}
        for link, number in self.links.items():
            if node.name in link:
                (peer,) = link - {node.name}
                view[peer] = number
                if node.view.get(peer) != number:
                    node.heard[peer] = self.round  # a fresh link counts as hearing from it
        if set(view) != set(node.view):
            node.view = view
            self.fan_out(node, node.election.view({p: self.nodes[p].priority for p in view}))
        node.view = view
        for peer in list(node.reports):
            if peer not in view:
                del node.reports[peer]
                node.serving.pop(peer, None)
        self.watch_ring_links(node)
        # Frames in arrival order, per link.
        for peer in list(view):
            q = self.queues.get((peer, node.name))
            while q and frozenset((peer, node.name)) in self.links:
                self.receive(node, peer, q.popleft())
                node.heard[peer] = self.round
        # The compute thread finishes loading.
        if node.report.state == LOADING and self.round >= node.loaded_at:
            node.report = Report(node.report.plan, LOADED)
            self.send(node, node.report.plan.node, ("loaded", node.report))
        self.lead(node, now)
        for peer in node.view:
            self.send(node, peer, ("beat", node.election.announcement(), node.report, node.ready))

    def watch_ring_links(self, node: Node) -> None:
        """As StageHost does: a loaded stage whose link to a ring neighbour drops or is re-made is broken."""
        if node.report.state != LOADED or node.plan is None:
            return
        term, stages = node.plan
        i = stages.index(node.name)
        neighbours = {term.node if i == 0 else stages[i - 1]} | ({stages[i + 1]} if i + 1 < len(stages) else set())
        for n in neighbours - {node.name}:
            if n in node.view and n not in node.ring_links:
                node.ring_links[n] = node.view[n]
            elif n in node.ring_links and node.view.get(n) != node.ring_links[n]:
                node.report = Report(term, BROKEN, f"link to {n} lost")
                self.send(node, term.node, ("loaded", node.report))
                return

    def lead(self, node: Node, now: float) -> None:
        e = node.election
        if not e.is_leader:
            node.reconciler.reset()
            node.ready = None
            return
        members = {node.name: Member(0, node.holder, node.report)}
        for peer, number in node.view.items():
            members[peer] = Member(number, self.nodes[peer].holder, node.reports.get(peer))
        d = node.reconciler.tick(now, members)
        if d.plan_over is not None:
            self.fan_out(node, e.next_term())
            term = e.term
            # Placement stands in: holders in ring order, the leader first if it holds layers.
            stages = tuple(sorted(d.plan_over, key=lambda n: (n != node.name, natural_key(n))))
            node.reconciler.planned(now, term, stages, d.plan_over, members)
            self.plans[term] = stages
            node.ready = None
            for member in members:
                self.send(node, member, ("plan", term, stages))
            return
        for member in d.inform:
            self.send(node, member, ("plan", node.reconciler.term, self.plans[node.reconciler.term]))
        node.ready = node.reconciler.term if d.ready else None

    def receive(self, node: Node, peer: str, msg: tuple) -> None:
        kind = msg[0]
        if kind == "elect":
            self.fan_out(node, node.election.receive(peer, msg[1]))
        elif kind == "beat":
            _, announce, report, serving = msg
            self.fan_out(node, node.election.receive(peer, announce))
            node.reports[peer] = report
            node.serving[peer] = serving
        elif kind == "loaded":
            node.reports[peer] = msg[1]
        elif kind == "plan":
            self.take_plan(node, peer, msg[1], msg[2])

    def take_plan(self, node: Node, sender: str, term: Term, stages: tuple[str, ...]) -> None:
        current = node.plan[0] if node.plan else None
        if plan_refusal(term, sender, node.election.leader, current) is not None:
            return
        if current == term:
            if node.report.state in (LOADED, OUTSIDE):
                self.send(node, sender, ("loaded", node.report))
            return
        node.plan = (term, stages)
        node.ring_links = {}
        if node.name in stages:
            node.report = Report(term, LOADING)
            node.loaded_at = self.round + self.rng.randint(0, 2)
        else:
            node.report = Report(term, OUTSIDE)
            self.send(node, sender, ("loaded", node.report))

    def send(self, node: Node, to: str, msg: tuple) -> None:
        if to == node.name:
            self.receive(node, node.name, msg)
        elif frozenset((node.name, to)) in self.links:
            self.queues[node.name, to].append(msg)

    def fan_out(self, node: Node, msgs: list) -> None:
        for msg in msgs:
            for peer in node.view:
                self.send(node, peer, ("elect", msg))

    # properties

    def check(self) -> None:
        for n, node in self.nodes.items():
            assert node.election.term >= self.terms.get(n, Term(0, "")), f"{n}'s term went back"
            self.terms[n] = node.election.term
            if node.plan is not None:
                term, stages = node.plan
                assert self.plans[term] == stages, f"{n} runs a plan {term} that differs from the one made under it"
            if node.ready is not None:
                assert node.ready.node == n and node.election.is_leader
        # At most one serving plan per term: each term named one plan when it was made (above),
        # and no two leaders serve plans of one term.
        serving = [node.ready for node in self.nodes.values() if node.ready is not None]
        assert len(serving) == len(set(serving)), f"two leaders serve one term: {serving}"

    def check_settled(self) -> None:
        """One leader, the top of the ranking, serving one plan over every holder, taken by every node."""
        pins = {node.election.pin for node in self.nodes.values()}
        pin = max(pins)
        top = rank({n: node.priority for n, node in self.nodes.items()}, pin)[0]
        leader = self.nodes[top]
        state = "\n".join(
            f"  {n}: leader={x.election.leader} term={x.election.term} plan={x.plan} report={x.report} ready={x.ready}"
            for n, x in self.nodes.items()
        )
        assert all(x.election.leader == top for x in self.nodes.values()), f"not all follow {top}:\n{state}"
        assert leader.ready is not None, f"{top} leads but does not serve:\n{state}"
        holders = sorted((n for n, x in self.nodes.items() if x.holder), key=natural_key)
        assert sorted(self.plans[leader.ready], key=natural_key) == holders, state
        for n, x in self.nodes.items():
            assert x.plan is not None and x.plan[0] == leader.ready, f"{n} does not run {leader.ready}:\n{state}"
            assert x.report.state == (LOADED if x.holder else OUTSIDE), state
            if n != top:
                linked = top in x.view
                ok, why = follower_readiness(x.election.leader, linked, x.serving.get(top), "", x.report)
                assert ok, f"{n}: {why}\n{state}"


NAMES = ["node1", "node2", "node3", "node10", "node11"]


@st.composite
def scenarios(draw):
    n = draw(st.integers(2, 5))
    names = NAMES[:n]
    nodes = {name: (draw(st.integers(0, 2)), draw(st.booleans()) or name == names[-1]) for name in names}
    node = st.sampled_from(names)
    fault = st.one_of(
        st.tuples(st.just("stall"), node, st.integers(1, 3 * DEAD_AFTER_ROUNDS)),
        st.tuples(st.just("drop"), node, node),
        st.tuples(st.just("partition"), st.lists(st.booleans(), min_size=n, max_size=n)),
        st.tuples(st.just("heal")),
        st.tuples(st.just("pin"), node, st.none() | node),
        st.tuples(st.just("run"), st.integers(1, 12)),
    )
    return nodes, draw(st.lists(fault, max_size=30))


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_faults_never_give_one_term_two_plans_and_the_cluster_heals(scenario, rng):
    nodes, faults = scenario
    sim = Sim(nodes, rng)
    sim.run(SETTLE_ROUNDS)
    sim.check_settled()  # a clean start serves too
    for op, *args in faults:
        if op == "drop" and args[0] == args[1]:
            continue
        getattr(sim, op)(*args)  # every round checks: terms grow, one plan per term
        sim.step()
    sim.heal()
    for node in sim.nodes.values():
        node.stalled_until = min(node.stalled_until, sim.round)
    sim.run(SETTLE_ROUNDS)
    sim.check_settled()
    sim.run(10)
    sim.check_settled()  # and it stays so: nothing flaps once the faults stop


def test_the_stalled_leader_wedge_of_issue_7_heals():
    """The leader stalls past dead_after, another leads meanwhile, the old one comes back and leads again."""
    sim = Sim({"node1": (0, True), "node2": (0, True), "node3": (0, True)}, random.Random(1))
    sim.run(SETTLE_ROUNDS)
    sim.check_settled()
    first = sim.nodes["node1"].ready
    sim.stall("node1", 20)  # ten seconds
    sim.run(10)
    assert sim.nodes["node2"].ready is not None, "node2 should serve while node1 sleeps"
    sim.run(10 + SETTLE_ROUNDS)
    sim.check_settled()
    assert sim.nodes["node1"].ready > first
