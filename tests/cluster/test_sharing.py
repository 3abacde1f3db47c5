"""ringd.cluster.sharing: how instances share the Macs, pure rules, property-tested."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.cluster.sharing import Held, Usage, eviction_order, expired, kv_shares, next_expiry, fewest_nodes, pick_replica, regroup, room_left, victims

GIB = 2**30

held_st = st.builds(Held, weights=st.integers(0, 64 * GIB), reserve=st.integers(0, 8 * GIB))
names_st = st.text("abcdefgh", min_size=1, max_size=4)
helds_st = st.dictionaries(names_st, held_st, max_size=6)
budget_st = st.none() | st.integers(0, 256 * GIB)


# --- room and KV shares -------------------------------------------------------

def test_room_left_examples():
    assert room_left(None, [Held(10, 2)]) is None
    assert room_left(100, []) == 100
    assert room_left(100, [Held(40, 10), Held(20, 5)]) == 25
    assert room_left(50, [Held(40, 20)]) == -10  # over-committed: no room, said as a number


@given(budget_st, st.lists(held_st, max_size=6))
def test_room_left_is_budget_less_claims(budget, held):
    room = room_left(budget, held)
    if budget is None:
        assert room is None
    else:
        assert room == budget - sum(h.weights + h.reserve for h in held)


def test_kv_shares_examples():
    # One instance: what it had before instances existed, budget less weights.
    assert kv_shares(100, {"a": Held(60, 10)}) == {"a": 40}
    # free = 100 - 45 = 55: 27 each, the odd byte to "a" (first by name, whatever the map's order).
    assert kv_shares(100, {"b": Held(20, 5), "a": Held(10, 10)}) == {"a": 10 + 28, "b": 5 + 27}
    # Over-committed: each keeps its reserve, nobody gets more.
    assert kv_shares(50, {"a": Held(40, 10), "b": Held(20, 5)}) == {"a": 10, "b": 5}
    assert kv_shares(None, {"a": Held(1, 1), "b": Held(2, 2)}) == {"a": None, "b": None}
    assert kv_shares(100, {}) == {}


@given(budget_st, helds_st)
def test_kv_shares_properties(budget, held):
    shares = kv_shares(budget, held)
    assert set(shares) == set(held)
    if budget is None:
        assert all(s is None for s in shares.values())
        return
    if not held:
        return  # nobody to share among (the free room is there for a new instance: room_left)
    weights = sum(h.weights for h in held.values())
    claims = sum(h.claim for h in held.values())
    for name, h in held.items():
        assert shares[name] >= h.reserve
    free = max(0, budget - claims)
    assert sum(shares.values()) == sum(h.reserve for h in held.values()) + free
    if budget >= claims:
        assert sum(shares.values()) <= budget - weights
    # Equal split of the free room: no two instances' extras differ by more than a byte.
    extras = [shares[n] - held[n].reserve for n in sorted(held)]
    assert max(extras) - min(extras) <= 1
    assert extras == sorted(extras, reverse=True)  # the odd bytes go to the first names


@given(st.integers(0, 256 * GIB), held_st)
def test_one_instance_gets_budget_less_weights(budget, h):
    if budget >= h.claim:
        assert kv_shares(budget, {"only": h}) == {"only": budget - h.weights}


def test_held_refuses_negative_bytes():
    with pytest.raises(ValueError, match="weights=-1"):
        Held(-1, 0)


# --- keep_alive and eviction ---------------------------------------------------

usage_st = st.builds(
    Usage,
    name=names_st,
    pinned=st.booleans(),
    active=st.integers(0, 3),
    last_used=st.floats(0, 1e6, allow_nan=False),
    keep_alive=st.none() | st.floats(0, 1e5, allow_nan=False),
)


def _unique(usages):
    return list({u.name: u for u in usages}.values())


usages_st = st.lists(usage_st, max_size=8).map(_unique)


def _u(name, last_used=0.0, keep_alive=300.0, active=0, pinned=False):
    return Usage(name, pinned, active, last_used, keep_alive)


def test_expiry_examples():
    fleet = [
        _u("pinned", pinned=True, keep_alive=0.0),
        _u("busy", active=2, keep_alive=0.0),
        _u("forever", keep_alive=None),
        _u("b", last_used=10.0, keep_alive=300.0),
        _u("a", last_used=100.0, keep_alive=0.0),  # keep_alive 0: unload as soon as it is idle
    ]
    assert next_expiry(fleet) == 100.0
    assert expired(fleet, 99.9) == []
    assert expired(fleet, 100.0) == ["a"]
    assert expired(fleet, 310.0) == ["a", "b"]
    assert expired(fleet, 1e12) == ["a", "b"]
    assert next_expiry([_u("forever", keep_alive=None), _u("p", pinned=True)]) is None


@given(usages_st, st.floats(0, 2e6, allow_nan=False))
def test_expired_rule(usages, now):
    out = expired(usages, now)
    assert out == sorted(out)
    for u in usages:
        due = u.active == 0 and not u.pinned and u.keep_alive is not None and u.last_used + u.keep_alive <= now
        assert (u.name in out) == due


@given(usages_st)
def test_nothing_expires_before_next_expiry_and_something_does_at_it(usages):
    t = next_expiry(usages)
    if t is None:
        assert expired(usages, 1e300) == []
        return
    assert expired(usages, t) != []
    assert expired(usages, math.nextafter(t, -math.inf)) == []  # the float just before it


@given(usages_st)
def test_eviction_order_is_idle_unpinned_least_recently_used_first(usages):
    order = eviction_order(usages)
    by_name = {u.name: u for u in usages}
    assert len(order) == len(set(order))
    assert set(order) == {u.name for u in usages if u.active == 0 and not u.pinned}
    assert all(by_name[n].active == 0 and not by_name[n].pinned for n in order)
    keys = [(by_name[n].last_used, n) for n in order]
    assert keys == sorted(keys)


def test_eviction_order_example():
    fleet = [_u("c", 5.0), _u("b", 1.0, keep_alive=None), _u("a", 5.0), _u("busy", 0.0, active=1), _u("pin", 0.0, pinned=True)]
    assert eviction_order(fleet) == ["b", "a", "c"]


@given(st.lists(names_st, unique=True, max_size=7), st.sets(st.frozensets(names_st, max_size=7), max_size=20))
def test_victims_is_the_shortest_prefix(order, fitting):
    """fits_without is an arbitrary predicate here (a set of removals that fit), not only a monotonic one."""
    calls = []

    def fits_without(removed):
        calls.append(removed)
        return removed in fitting

    got = victims(order, fits_without)
    assert len(calls) <= len(order) + 1
    brute = next((list(order[:n]) for n in range(len(order) + 1) if frozenset(order[:n]) in fitting), None)
    assert got == brute


def test_victims_examples():
    need = {"a": 3, "b": 5, "c": 2}

    def fits(room):
        return lambda removed: sum(need[n] for n in removed) >= room

    assert victims(["a", "b", "c"], fits(0)) == []
    assert victims(["a", "b", "c"], fits(7)) == ["a", "b"]
    assert victims(["a", "b", "c"], fits(11)) is None
    assert victims([], fits(1)) is None


# --- replicas --------------------------------------------------------------------

@given(st.lists(st.tuples(names_st, st.integers(0, 20)), min_size=1, max_size=8))
def test_pick_replica_least_work_first_of_ties(replicas):
    name = pick_replica(replicas)
    least = min(w for _, w in replicas)
    first = next(i for i, (_, w) in enumerate(replicas) if w == least)
    assert name == replicas[first][0]


def test_pick_replica_examples():
    assert pick_replica([("r0", 3), ("r1", 1), ("r2", 1)]) == "r1"
    assert pick_replica([("r0", 0)]) == "r0"
    with pytest.raises(ValueError, match="no replicas"):
        pick_replica([])


def test_usage_refuses_nonsense():
    with pytest.raises(ValueError, match="active"):
        Usage("x", False, -1, 0.0, None)
    with pytest.raises(ValueError, match="keep_alive"):
        Usage("x", False, 0, 0.0, float("nan"))


# --- regroup -----------------------------------------------------------------------------

node_names = st.lists(st.sampled_from([f"n{i}" for i in range(12)]), unique=True, max_size=12)


@given(live=node_names, replicas=st.integers(1, 6))
def test_a_new_count_of_replicas_cuts_the_nodes_into_even_contiguous_groups(live, replicas):
    groups = regroup([], live, replicas)
    assert len(groups) == replicas
    assert [n for g in groups for n in sorted(g, key=live.index)] == live  # every node once, in order
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(before=node_names, after=node_names, replicas=st.integers(1, 6))
def test_groups_stick_a_leaver_leaves_only_its_group_and_a_newcomer_joins_the_smallest(before, after, replicas):
    groups = regroup([], before, replicas)
    again = regroup(groups, after, replicas)
    assert set().union(*again) == set(after)
    assert sum(len(g) for g in again) == len(after)  # no node in two groups
    for old, new in zip(groups, again):
        assert old & set(after) <= new  # nobody who stayed was moved
    if set(after) <= set(before):
        assert again == [g & set(after) for g in groups]


def test_regroup_examples():
    assert regroup([], ["a", "b", "c", "d"], 2) == [frozenset("ab"), frozenset("cd")]
    assert regroup([frozenset("ab"), frozenset("cd")], ["a", "c", "d"], 2) == [frozenset("a"), frozenset("cd")]
    assert regroup([frozenset("a"), frozenset("cd")], ["a", "c", "d", "e"], 2) == [frozenset("ae"), frozenset("cd")]
    assert regroup([], ["a"], 2) == [frozenset("a"), frozenset()]


@given(st.lists(st.one_of(st.none(), st.integers(0, 100)), max_size=8), st.integers(1, 300))
def test_fewest_nodes_is_the_shortest_run_of_the_roomiest_that_holds(rooms_, need):
    rooms = [(f"n{i}", r) for i, r in enumerate(rooms_)]
    room = dict(rooms)

    def holds(nodes):  # a model of `need` bytes, split any way (None: no limit)
        return any(room[n] is None for n in nodes) or sum(room[n] for n in nodes) >= need

    got = fewest_nodes(rooms, holds)
    if got is None:
        assert not holds([n for n, _ in rooms])
        return
    assert holds(got) and (len(got) == 1 or not holds(got[:-1]))
    roomiest = sorted((float("inf") if r is None else r for _, r in rooms), reverse=True)[: len(got)]
    assert sorted((float("inf") if room[n] is None else room[n] for n in got), reverse=True) == roomiest


def test_fewest_nodes_examples():
    assert fewest_nodes([("a", 10), ("b", 50), ("c", 50)], lambda ns: sum(dict(a=10, b=50, c=50)[n] for n in ns) >= 40) == ["b"]
    assert fewest_nodes([("a", 10), ("b", 50), ("c", 50)], lambda ns: sum(dict(a=10, b=50, c=50)[n] for n in ns) >= 90) == ["b", "c"]
    assert fewest_nodes([("a", 10)], lambda ns: False) is None
