"""ringd.cluster.groups: tensor_parallel auto's choice, as pure functions of links and compute."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ringd.cluster.groups import ALL_REDUCE_OVERHEAD_US, GROUPS_MARGIN, Grouping, all_reduce_us, choose_groups
from ringd.cluster.linkcost import Measured

HIDDEN_BYTES = 4096


def mesh(nodes, rtt_us) -> dict:
    """Every pair's link: ``rtt_us(a, b)`` microseconds, no bandwidth figure."""
    return {frozenset((a, b)): Measured(rtt_us(a, b)) for i, a in enumerate(nodes) for b in nodes[i + 1 :]}


ROOMS = {"a1": 0, "a2": 0, "b1": 1, "b2": 1}


def rooms(inside_us: int, across_us: int) -> dict:
    return mesh(list(ROOMS), lambda a, b: inside_us if ROOMS[a] == ROOMS[b] else across_us)


def test_groups_form_inside_rooms_where_a_layer_outweighs_four_all_reduces():
    links = rooms(2_000, 40_000)  # Thunderbolt as this VM reads it; a slow backhaul
    layer = dict.fromkeys(ROOMS, 25_000.0)
    g = choose_groups(("a1", "a2", "b1", "b2"), links, layer, 24, HIDDEN_BYTES)
    assert g.groups == (("a1", "a2"), ("b1", "b2")) and g.size == 2
    assert g.why.startswith("groups of 2 (a1+a2, b1+b2)") and "pays above" in g.why
    # The ring's order may start a group anywhere: the offset whose all-reduces stay inside the rooms wins.
    g = choose_groups(("a2", "b1", "b2", "a1"), links, layer, 24, HIDDEN_BYTES)
    assert {frozenset(x) for x in g.groups} == {frozenset(("a1", "a2")), frozenset(("b1", "b2"))}


def test_no_groups_where_the_links_cost_more_than_the_split_saves():
    layer = dict.fromkeys(ROOMS, 2_000.0)  # a small layer: four all-reduces of ~1.3 ms are more
    g = choose_groups(("a1", "a2", "b1", "b2"), rooms(2_000, 40_000), layer, 24, HIDDEN_BYTES)
    assert g.size == 1 and g.groups == (("a1",), ("a2",), ("b1",), ("b2",))
    assert g.why.startswith("no groups: a layer computes in ~2.00 ms on one Mac")


def test_links_nobody_measured_make_no_group_unless_the_ring_has_too_few_layers():
    g = choose_groups(("a1", "a2"), {}, {"a1": 1e9, "a2": 1e9}, 4, HIDDEN_BYTES)
    assert g.size == 1 and g.why == "no groups: links not measured yet"
    assert choose_groups(("a1",), {}, {"a1": 1.0}, 4, HIDDEN_BYTES).why == "no groups: 1 Mac(s) make no group"
    # Four Macs, two layers: a stage a Mac cannot be, so groups of two are the fewest there can be.
    g = choose_groups(("a1", "a2", "b1", "b2"), {}, dict.fromkeys(ROOMS, 1.0), 2, HIDDEN_BYTES)
    assert g.size == 2 and "too few layers" in g.why


def test_the_running_groups_stay_unless_others_save_the_margin():
    links = rooms(2_000, 2_100)  # every link nearly alike: another pairing saves next to nothing
    layer = dict.fromkeys(ROOMS, 25_000.0)
    running = Grouping((("a2", "b1"), ("b2", "a1")), 0, "")
    g = choose_groups(("a1", "a2", "b1", "b2"), links, layer, 24, HIDDEN_BYTES, allowed=[2], current=running)
    assert g.groups == running.groups
    moved = choose_groups(("a1", "a2", "b1", "b2"), rooms(2_000, 40_000), layer, 24, HIDDEN_BYTES, allowed=[2], current=running)
    assert moved.groups == (("a1", "a2"), ("b1", "b2"))


def test_an_all_reduce_costs_its_slowest_pair_and_the_handoffs():
    links = {frozenset(("x", "y")): Measured(100, 10**9), frozenset(("x", "z")): Measured(3_000), frozenset(("y", "z")): Measured(500)}
    assert all_reduce_us(("x", "y"), links, 1000) == 50 + 1 + ALL_REDUCE_OVERHEAD_US
    assert all_reduce_us(("x", "y", "z"), links, 1000) == 1_500 + ALL_REDUCE_OVERHEAD_US


@given(
    st.integers(1, 8).flatmap(lambda n: st.tuples(
        st.just(n),
        st.lists(st.integers(1, 50_000), min_size=n * n, max_size=n * n),
        st.lists(st.floats(1, 100_000), min_size=n, max_size=n),
        st.sets(st.integers(2, 8)),
    ))  # fmt: skip
)
def test_any_choice_partitions_the_ring_into_consecutive_equal_groups_no_slower_than_none(case):
    n, rtts, layers_us, allowed = case
    ring = tuple(f"n{i}" for i in range(n))
    links = mesh(ring, lambda a, b: rtts[int(a[1:]) * n + int(b[1:])])
    g = choose_groups(ring, links, dict(zip(ring, layers_us)), 12, HIDDEN_BYTES, allowed)
    members = [m for grp in g.groups for m in grp]
    assert sorted(members) == sorted(ring) and len({len(grp) for grp in g.groups}) == 1
    assert (g.size in allowed or g.size in (1, n)) and n % g.size == 0 and n // g.size <= 12
    start = ring.index(members[0])
    assert members == [ring[(start + i) % n] for i in range(n)], "groups are consecutive Macs of the ring"
    alone = choose_groups(ring, links, dict(zip(ring, layers_us)), 12, HIDDEN_BYTES, ())
    assert g.size == 1 or g.token_us <= (1 - GROUPS_MARGIN) * alone.token_us
    assert g.why
