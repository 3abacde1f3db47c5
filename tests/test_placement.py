"""ringd.placement: pure plan rules, property-tested."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.placement import Plan, PlacementError, even_split, make_plan, natural_key, parse_split


def test_worked_examples():
    assert even_split(28, 3) == [10, 9, 9]
    assert even_split(7, 4) == [2, 2, 2, 1]
    assert even_split(7, 1) == [7]


@given(layers=st.integers(1, 200), nodes=st.integers(1, 20))
def test_even_split_properties(layers, nodes):
    if nodes > layers:
        with pytest.raises(PlacementError):
            even_split(layers, nodes)
        return
    split = even_split(layers, nodes)
    assert sum(split) == layers and len(split) == nodes
    assert max(split) - min(split) <= 1
    assert split == sorted(split, reverse=True)  # low stages take the extra


@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(1, 50))
def test_plans_cover_every_layer_once_in_order(split, term):
    members = [(f"node{i}", f"127.0.0.1:{5000 + i}") for i in range(len(split))]
    plan = make_plan(term, "node0", "fp", sum(split), members, split)
    covered = [layer for s in plan.stages for layer in range(s.start, s.end)]
    assert covered == list(range(sum(split)))
    assert plan.split == split
    assert Plan.from_wire(plan.to_wire()) == plan
    assert plan.successor(members[-1][0]) is None
    for (a, _), (b, _) in zip(members, members[1:]):
        assert plan.successor(a).node == b


@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(-3, 3))
def test_splits_that_do_not_sum_are_refused(split, delta):
    members = [(f"n{i}", "") for i in range(len(split))]
    total = sum(split) + delta
    if delta == 0:
        make_plan(1, "n0", "fp", total, members, split)
    else:
        with pytest.raises(PlacementError, match="sums to"):
            make_plan(1, "n0", "fp", total, members, split)


@given(st.recursive(st.none() | st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4)))
def test_malformed_wire_plans_raise_placement_error(doc):
    try:
        Plan.from_wire(doc)
    except PlacementError:
        pass


def test_parse_split_and_natural_order():
    assert parse_split("1,5,1") == [1, 5, 1]
    with pytest.raises(PlacementError):
        parse_split("1,,2")
    with pytest.raises(PlacementError):
        parse_split("2,0")
    assert sorted(["node10", "node2", "node1"], key=natural_key) == ["node1", "node2", "node10"]
