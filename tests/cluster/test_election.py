"""ringd.cluster.election: ranking and pin rules, the wire form, and a simulated cluster under Hypothesis.

The simulator stands in for membership and the links (this module is sans-I/O,
so there is nothing real to run): nodes start, crash, restart with what they
persisted, partitions split and heal, pins are set from any node, and messages
are delivered one link at a time in an order Hypothesis picks.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.cluster.election import (
    NO_TERM,
    Announce,
    Election,
    ElectionError,
    Pin,
    Term,
    rank,
)
from ringd.base.names import natural_key

# Enough deliveries for any settle of <= 7 nodes; running past it means the rules never go quiet.
MAX_DELIVERIES_TO_QUIESCENCE = 20_000


# --- ranking and pins -----------------------------------------------------------------


def test_ranking_examples():
    auto = Pin()
    assert rank({"node10": 0, "node2": 0, "node1": 0}, auto) == ["node1", "node2", "node10"]
    assert rank({"a": 0, "b": 5, "c": 1}, auto) == ["b", "c", "a"]  # priority beats id
    assert rank({"a": 0, "b": 5, "c": 1}, Pin(1, "a")) == ["a", "b", "c"]  # pin beats priority
    assert rank({"a": 0, "b": 5}, Pin(1, "gone")) == ["b", "a"]  # a dead pinned node is ignored
    assert rank({"n01": 0, "n1": 0}, auto) == ["n01", "n1"]  # equal to natural order, still one order
    assert rank({"solo": 3}, Pin(7, None)) == ["solo"]


def test_pin_ordering():
    assert Pin(2, None) > Pin(1, "a")  # the higher epoch wins, whatever it says
    assert Pin(1, "a") > Pin(1, None)  # at equal epochs a pin beats auto
    assert Pin(1, "b") > Pin(1, "a")
    assert max(Pin(1, "a"), Pin(1, "b"), Pin(0, "z")) == Pin(1, "b")
    assert Pin(3, "a").next("b") == Pin(4, "b") and Pin(4, "b").next(None) == Pin(5, None)
    assert Term(2, "a") > Term(1, "z") and Term(2, "b") > Term(2, "a") > NO_TERM


@given(
    st.lists(st.tuples(st.integers(0, 5), st.none() | st.sampled_from(["a", "b", "c"])), min_size=1, max_size=6)
)
def test_pins_merge_to_the_same_winner_in_any_order(pins):
    pins = [Pin(e, n) for e, n in pins]
    winners = {max(order) for order in (pins, pins[::-1], sorted(pins), sorted(pins, reverse=True))}
    assert len(winners) == 1


# --- wire form ---------------------------------------------------------------------------

node_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,10}", fullmatch=True)
announces = st.builds(
    Announce,
    st.builds(Term, st.integers(1, 2**53 - 1), node_ids) | st.just(NO_TERM),
    st.none() | node_ids,
    st.builds(Pin, st.integers(0, 2**53 - 1), st.none() | node_ids),
)


@given(announces)
def test_announce_round_trips(msg):
    assert Announce.from_wire(msg.to_wire()) == msg
    assert Pin.from_wire(msg.pin.to_wire()) == msg.pin and Term.from_wire(msg.term.to_wire()) == msg.term


GOOD = {"term": [3, "node1"], "leader": "node1", "pin": [1, None]}


@pytest.mark.parametrize(
    "doc,needle",
    [
        (None, "keys term, leader and pin"),
        ([], "keys term, leader and pin"),
        ({"term": [1, "a"], "pin": [0, None]}, "keys term, leader and pin"),
        ({**GOOD, "extra": 1}, "keys term, leader and pin"),
        ({**GOOD, "term": [3]}, "term must be a 2-item list"),
        ({**GOOD, "term": "3:node1"}, "term must be a 2-item list"),
        ({**GOOD, "term": [-1, "node1"]}, "term number must be an integer"),
        ({**GOOD, "term": [True, "node1"]}, "term number must be an integer"),
        ({**GOOD, "term": [1.5, "node1"]}, "term number must be an integer"),
        ({**GOOD, "term": [2**53, "node1"]}, "term number must be an integer"),
        ({**GOOD, "term": [3, ""]}, "term node must be a node id"),
        ({**GOOD, "term": [3, "bad id"]}, "term node must be a node id"),
        ({**GOOD, "leader": 7}, "leader must be a node id"),
        ({**GOOD, "leader": "x" * 64}, "leader must be a node id"),
        ({**GOOD, "pin": [None, "a"]}, "pin epoch must be an integer"),
        ({**GOOD, "pin": [1, ""]}, "pinned node must be a node id"),
        ({**GOOD, "pin": {"epoch": 1}}, "pin must be a 2-item list"),
    ],
)
def test_malformed_messages_raise_election_error(doc, needle):
    assert Announce.from_wire(GOOD).term == Term(3, "node1")
    with pytest.raises(ElectionError, match=needle):
        Announce.from_wire(doc)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["term", "leader", "pin", "x"]), c, max_size=4),
)


@given(json_like)
def test_any_json_either_parses_or_raises_election_error(doc):
    try:
        Announce.from_wire(doc)
    except ElectionError:
        pass


# --- one node's rules, worked examples ------------------------------------------------------


def exchange(nodes: dict[str, Election], pending: list[tuple[str, Announce]]) -> int:
    """Deliver (sender, msg) to the sender's view until quiet, FIFO; returns how many were delivered."""
    queue, delivered = deque(pending), 0
    while queue:
        sender, msg = queue.popleft()
        for peer in nodes[sender].members:
            if peer != sender:
                delivered += 1
                assert delivered < MAX_DELIVERIES_TO_QUIESCENCE, "the nodes never went quiet"
                queue.extend((peer, m) for m in nodes[peer].receive(sender, msg))
    return delivered


def test_two_nodes_fail_over_and_back():
    a, b = Election("a", 1), Election("b", 0)
    nodes = {"a": a, "b": b}
    both = {"a": 1, "b": 0}
    exchange(nodes, [("a", m) for m in a.view(both)] + [("b", m) for m in b.view(both)])
    assert (a.is_leader, b.leader, a.term) == (True, "a", Term(1, "a"))

    exchange(nodes, [("b", m) for m in b.view({"b": 0})])  # a dies: b alone must lead
    assert b.is_leader and b.term == Term(2, "b")

    a2 = Election("a", 1, a.pin, a.term)  # a restarts with what it persisted
    nodes["a"] = a2
    exchange(nodes, [("a", m) for m in a2.view(both)] + [("b", m) for m in b.view(both)])
    assert a2.is_leader and b.leader == "a" and not b.is_leader
    assert a2.term == b.term == Term(3, "a")  # above b's term 2, so plans of term 2 are stale


def test_a_pin_moves_the_leader_and_auto_moves_it_back():
    nodes = {n: Election(n, p) for n, p in [("a", 2), ("b", 1), ("c", 0)]}
    view = {"a": 2, "b": 1, "c": 0}
    exchange(nodes, [(n, m) for n, e in nodes.items() for m in e.view(view)])
    assert {e.leader for e in nodes.values()} == {"a"}

    c = nodes["c"]  # ringctl talks to c
    exchange(nodes, [("c", m) for m in c.set_pin(c.pin.next("b"))])
    assert {e.leader for e in nodes.values()} == {"b"} and nodes["b"].is_leader
    assert {e.pin for e in nodes.values()} == {Pin(1, "b")}

    exchange(nodes, [("a", m) for m in nodes["a"].set_pin(Pin(0, "c"))])  # an older pin changes nothing
    assert {e.leader for e in nodes.values()} == {"b"}

    exchange(nodes, [("c", m) for m in c.set_pin(c.pin.next(None))])
    assert {e.leader for e in nodes.values()} == {"a"}
    assert len({e.term for e in nodes.values()}) == 1


def test_a_manual_pin_survives_a_restart():
    pinned = Election("low", 0, pin=Pin(4, "low"), term=Term(9, "high"))
    assert pinned.view({"high": 10, "low": 0}) == [Announce(Term(10, "low"), "low", Pin(4, "low"))]


def test_messages_from_outside_the_view_are_ignored():
    a = Election("a", 0)
    a.view({"a": 0})
    assert a.receive("stranger", Announce(Term(50, "stranger"), "stranger", Pin(9, "stranger"))) == []
    assert (a.term, a.pin, a.leader) == (Term(1, "a"), Pin(), "a")


def test_views_that_disagree_do_not_claim_forever():
    # a sees b, b does not (yet) see a: each thinks it should lead. Without ignoring
    # a non-member, every claim would provoke a higher one, message after message.
    a, b = Election("a", 5), Election("b", 0)
    nodes = {"a": a, "b": b}
    delivered = exchange(nodes, [("a", m) for m in a.view({"a": 5, "b": 0})] + [("b", m) for m in b.view({"b": 0})])
    assert delivered <= 2 and a.is_leader and b.is_leader and a.term != b.term


def test_a_follower_waits_for_the_new_tops_claim():
    c = Election("c", 0)
    c.view({"a": 2, "b": 1, "c": 0})
    c.receive("a", Announce(Term(4, "a"), "a", Pin()))
    assert c.leader == "a"
    c.view({"b": 1, "c": 0})  # a died; b should lead but has not claimed yet
    assert c.leader is None and not c.is_leader
    c.receive("b", Announce(Term(5, "b"), "b", Pin()))
    assert c.leader == "b"


# --- the simulated cluster ---------------------------------------------------------------------


class Cluster:
    """Nodes, per-link FIFO queues, partitions, and what each node persisted.

    Views are what membership would report: the live nodes of the node's
    component. A crash closes its links (their queues are lost); a partition
    either loses the messages queued across it or delays them until it heals.
    Every invariant is checked after every step.
    """

    def __init__(self, priorities: dict[str, int], rng: random.Random, persist_term: bool = True):
        self.priority = priorities
        self.rng = rng
        self.persist_term = persist_term
        self.alive: dict[str, Election] = {}
        self.given: dict[str, dict | None] = {}  # the last view handed to each live node
        self.disk: dict[str, tuple[Pin, Term]] = {}
        self.run = {n: 0 for n in priorities}  # restarts: a claim belongs to (node, run)
        self.part = {n: 0 for n in priorities}
        self.links: dict[tuple[str, str], deque] = defaultdict(deque)
        self.claims: dict[Term, tuple[str, int]] = {}
        self.seen_term: dict[str, Term] = {}

    # operations

    def start(self, node: str) -> None:
        if node in self.alive:
            return
        pin, term = self.disk.get(node, (Pin(), NO_TERM))
        self.run[node] += 1
        self.alive[node] = Election(node, self.priority[node], pin, term if self.persist_term else None)
        self.given[node] = None
        self.refresh_views()

    def crash(self, node: str) -> None:
        if node not in self.alive:
            return
        del self.alive[node], self.given[node]
        for link in [k for k in self.links if node in k]:
            del self.links[link]
        self.refresh_views()

    def partition(self, sides: list[bool], lose_in_flight: bool) -> None:
        for n, side in zip(self.priority, sides):
            self.part[n] = int(side)
        if lose_in_flight:
            for src, dst in list(self.links):
                if self.part[src] != self.part[dst]:
                    del self.links[src, dst]
        self.refresh_views()

    def heal(self) -> None:
        self.part = {n: 0 for n in self.priority}
        self.refresh_views()

    def pin(self, at: str, target: str | None) -> None:
        if at in self.alive:
            e = self.alive[at]
            self.sent(at, e.set_pin(e.pin.next(target)))

    def deliver(self, count: int) -> int:
        done = 0
        while done < count:
            ready = self.deliverable()
            if not ready:
                break
            src, dst = self.rng.choice(ready)
            msg = self.links[src, dst].popleft()
            self.sent(dst, self.alive[dst].receive(src, Announce.from_wire(msg.to_wire())))
            done += 1
        return done

    def settle(self) -> None:
        total = self.deliver(MAX_DELIVERIES_TO_QUIESCENCE)
        assert not self.deliverable(), f"still not quiet after {total} deliveries"
        self.check_quiescent()

    # plumbing

    def component(self, node: str) -> list[str]:
        return sorted(n for n in self.alive if self.part[n] == self.part[node])

    def deliverable(self) -> list[tuple[str, str]]:
        return sorted(
            (s, d)
            for (s, d), q in self.links.items()
            if q and s in self.alive and d in self.alive and self.part[s] == self.part[d]
        )

    def refresh_views(self) -> None:
        order = sorted(self.alive)
        self.rng.shuffle(order)  # membership reports changes to nodes in no particular order
        for n in order:
            view = {m: self.priority[m] for m in self.component(n)}
            if view != self.given[n]:
                self.given[n] = view
                self.sent(n, self.alive[n].view(view))

    def sent(self, node: str, msgs: list[Announce]) -> None:
        """What the daemon does with a call's result: persist, then fan out to the view."""
        e = self.alive[node]
        self.disk[node] = (e.pin, e.term)
        for msg in msgs:
            for peer in e.members:
                if peer != node:
                    self.links[node, peer].append(msg)
        self.check_step(node)

    # properties

    def check_step(self, node: str) -> None:
        e = self.alive[node]
        assert e.term >= self.seen_term.get(node, NO_TERM), f"{node}'s term went back to {e.term}"
        self.seen_term[node] = e.term
        assert e.leader is None or e.leader in e.members, f"{node} follows {e.leader}, outside its view"
        if e.is_leader:
            assert e.term.node == node, f"{node} leads {e.term}, a term of another node"
            owner = self.claims.setdefault(e.term, (node, self.run[node]))
            assert owner == (node, self.run[node]), f"{e.term} claimed twice: by {owner} and by run {self.run[node]}"
        leading = [x.term for x in self.alive.values() if x.is_leader]
        assert len(leading) == len(set(leading)), f"two leaders in one term: {leading}"

    def check_quiescent(self) -> None:
        """Per component: one pin, one term, one leader, and it is the top of the ranking."""
        for group in {tuple(self.component(n)) for n in self.alive}:
            nodes = [self.alive[n] for n in group]
            pins = {e.pin for e in nodes}
            terms = {e.term for e in nodes}
            assert len(pins) == 1, f"component {group} holds pins {pins}"
            assert len(terms) == 1, f"component {group} holds terms {terms}"
            pin, term = pins.pop(), terms.pop()
            # The expected leader, computed without rank() so the two check each other.
            top = min(group, key=lambda n: (n != pin.node, -self.priority[n], natural_key(n), n))
            leaders = [e.leader for e in nodes]
            assert leaders == [top] * len(nodes), f"component {group} follows {leaders}, not {top}"
            assert [n for n, e in zip(group, nodes) if e.is_leader] == [top]
            assert term.node == top and self.claims[term][0] == top


NAMES = ["node1", "node2", "node3", "node9", "node10", "node11", "node20"]


@st.composite
def histories(draw):
    n = draw(st.integers(2, 7))
    names = draw(st.permutations(NAMES))[:n]
    if draw(st.booleans()):
        priorities = {name: draw(st.integers(0, 2)) for name in names}
    else:
        priorities = dict.fromkeys(names, 0)  # all tied: the id decides
    first = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    node = st.sampled_from(names)
    op = st.one_of(
        st.tuples(st.just("start"), node),
        st.tuples(st.just("crash"), node),
        st.tuples(st.just("partition"), st.lists(st.booleans(), min_size=n, max_size=n), st.booleans()),
        st.tuples(st.just("heal")),
        st.tuples(st.just("pin"), node, st.none() | node),
        st.tuples(st.just("deliver"), st.integers(1, 30)),
        st.tuples(st.just("settle")),
    )
    return priorities, first, draw(st.lists(op, max_size=40))


def play(priorities, first, ops, rng, persist_term=True) -> Cluster:
    c = Cluster(priorities, rng, persist_term)
    for n in first:
        c.start(n)
    for op, *args in ops:
        getattr(c, op)(*args)
    return c


@settings(max_examples=300, deadline=None)
@given(histories(), st.randoms(use_true_random=False))
def test_one_leader_per_term_and_one_leader_after_healing(history, rng):
    c = play(*history, rng)  # every step checks: terms grow, one claimant per term
    c.settle()  # each component agrees on its top node
    c.heal()
    c.settle()  # the whole cluster does
    if c.alive:
        assert len({e.leader for e in c.alive.values()}) == 1
        assert max(e.term for e in c.alive.values()) == c.alive[next(iter(c.alive))].term


def test_a_restart_that_forgets_its_term_claims_a_used_one():
    # Why the daemon persists the term: node1 leads term (1, node1), dies, and
    # comes back cut off from node2. Without its term it claims (1, node1) again,
    # and node2 still holds the plan of the first run's term 1.
    ops = [("crash", "node1"), ("partition", [True, False], True), ("start", "node1")]
    with pytest.raises(AssertionError, match=r"claimed twice"):
        play({"node1": 1, "node2": 0}, ["node1", "node2"], [("settle",), *ops], random.Random(0), persist_term=False)
    c = play({"node1": 1, "node2": 0}, ["node1", "node2"], [("settle",), *ops], random.Random(0))
    assert c.alive["node1"].term == Term(2, "node1") and c.alive["node1"].is_leader
