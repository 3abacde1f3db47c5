"""ringd.cluster.placement: pure plan rules, property-tested."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.cluster.placement import GIB, STRATEGIES, ModelCost, NodeSpec, apportion, place, plan_for, shortfall, tensor_groups
from ringd.ring.plan import PlacementError, Plan, even_split, make_plan, parse_split, with_groups


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


# --- placement strategies ----------------------------------------------------

def _nodes(n, budgets=None, speeds=None, api_only=(), proportions=None):
    return [
        NodeSpec(
            f"node{i}",
            f"127.0.0.1:{5000 + i}",
            None if budgets is None else budgets[i],
            1.0 if speeds is None else speeds[i],
            None if proportions is None else proportions[i],
            i in api_only,
        )
        for i in range(n)
    ]


def _flat(num_layers, layer=1, embed=0, norm=0, head=0, kv=0):
    return ModelCost((layer,) * num_layers, embed, norm, head, kv)


def _slowest(nodes, counts):
    """max(layers_i / speed_i) over the nodes holding layers, exactly."""
    return max(Fraction(c) / Fraction(n.speed) for n, c in zip(nodes, counts) if not n.api_only)


def _fits(nodes, cost, counts):
    s = 0
    for n, c in zip(nodes, counts):
        if n.api_only:
            continue
        if n.budget is not None and cost.stage_need(s, s + c) > n.budget:
            return False
        s += c
    return True


def _all_splits(nodes, cost):
    """Every way to give each node holding layers at least one, in ring order (brute force)."""
    total, holders = len(cost.layers), [n for n in nodes if not n.api_only]
    for cuts in itertools.combinations(range(1, total), len(holders) - 1):
        bounds = (0, *cuts, total)
        it = iter([b - a for a, b in zip(bounds, bounds[1:])])
        yield [0 if n.api_only else next(it) for n in nodes]


@st.composite
def rings(draw, max_nodes=8, max_layers=80):
    num_layers = draw(st.integers(1, max_layers))
    sizes = draw(st.lists(st.integers(0, 1000), min_size=num_layers, max_size=num_layers))
    embed, norm, head, kv = draw(st.integers(0, 3000)), draw(st.integers(0, 50)), draw(st.sampled_from([0, 0, 700, 3000])), draw(st.integers(0, 100))
    cost = ModelCost(tuple(sizes), embed, norm, head, kv)
    whole = cost.stage_need(0, num_layers) + embed
    n = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(n):
        budget = draw(st.none() | st.integers(0, whole))
        speed = draw(st.sampled_from([1.0, 2.0, 3.0]) | st.floats(0.05, 500.0))
        proportion = draw(st.floats(0.01, 100.0))
        api_only = draw(st.integers(0, 3)) == 0  # sometimes all of them, which must be refused
        nodes.append(NodeSpec(f"node{i}", f"10.0.0.{i}:7000", budget, speed, proportion, api_only))
    return nodes, cost


def _check_result(nodes, cost, strategy, counts):
    assert len(counts) == len(nodes)
    for n, c in zip(nodes, counts):
        assert c == 0 if n.api_only else c >= 1
    assert sum(counts) == len(cost.layers)
    assert _fits(nodes, cost, counts)
    plan = plan_for(3, nodes[0].node, "fp", nodes, cost, strategy)  # Plan validates contiguity and coverage
    assert plan.split == [c for c in counts if c]
    assert [s.node for s in plan.stages] == [n.node for n in nodes if not n.api_only]
    covered = [layer for s in plan.stages for layer in range(s.start, s.end)]
    assert covered == list(range(len(cost.layers)))


@settings(max_examples=150, deadline=None)
@given(rings())
def test_every_strategy_places_every_layer_once_within_budgets(ring):
    nodes, cost = ring
    for strategy in STRATEGIES:
        try:
            counts = place(strategy, nodes, cost)
        except PlacementError as e:
            if all(n.api_only for n in nodes) or sum(not n.api_only for n in nodes) > len(cost.layers):
                continue
            assert "short by" in str(e) and "does not fit" in str(e), str(e)
            with pytest.raises(PlacementError):
                plan_for(1, "node0", "fp", nodes, cost, strategy)
            continue
        _check_result(nodes, cost, strategy, counts)
        assert place(strategy, list(nodes), cost) == counts  # deterministic


@settings(max_examples=150, deadline=None)
@given(rings())
def test_balanced_is_never_slower_than_uniform(ring):
    nodes, cost = ring
    try:
        uniform = place("uniform", nodes, cost)
    except PlacementError:
        return
    balanced = place("balanced", nodes, cost)  # uniform found a fitting split, so balanced must too
    assert _slowest(nodes, balanced) <= _slowest(nodes, uniform)
    holders = [n for n in nodes if not n.api_only]
    even = even_split(len(cost.layers), len(holders))
    it = iter(even)
    even_counts = [0 if n.api_only else next(it) for n in nodes]
    if _fits(nodes, cost, even_counts):
        assert _slowest(nodes, balanced) <= _slowest(nodes, even_counts)


@settings(max_examples=250, deadline=None)
@given(rings(max_nodes=4, max_layers=12))
def test_against_brute_force_on_small_rings(ring):
    nodes, cost = ring
    holders = [n for n in nodes if not n.api_only]
    if not holders or len(holders) > len(cost.layers):
        for strategy in STRATEGIES:
            with pytest.raises(PlacementError):
                place(strategy, nodes, cost)
        return
    fitting = [c for c in _all_splits(nodes, cost) if _fits(nodes, cost, c)]
    for strategy in STRATEGIES:
        if not fitting:
            # Raises only when truly nothing fits, and then says by how much.
            with pytest.raises(PlacementError, match="short by"):
                place(strategy, nodes, cost)
            continue
        counts = place(strategy, nodes, cost)  # something fits, so every strategy finds a split
        assert counts in fitting
        if strategy == "balanced":
            assert _slowest(nodes, counts) == min(_slowest(nodes, c) for c in fitting)


@settings(max_examples=150, deadline=None)
@given(rings(max_nodes=4, max_layers=12))
def test_shortfall_says_whether_placement_can_hold_the_model(ring):
    """What the model list says of a model ("fits the cluster's memory") is what placement would do:
    None exactly when some split fits every budget, else place's own reason."""
    nodes, cost = ring
    why = shortfall(nodes, cost)
    try:
        place("balanced", nodes, cost)
    except PlacementError as e:
        assert why is not None
        if "add up to" not in why:  # not a matter of memory: too many nodes, or none holding layers
            assert why == str(e)
    else:
        assert why is None


@given(st.integers(1, 200), st.lists(st.floats(0.01, 1000.0), min_size=1, max_size=12))
def test_apportion_properties(total, weights):
    if len(weights) > total:
        with pytest.raises(PlacementError):
            apportion(total, weights)
        return
    counts = apportion(total, weights)
    assert sum(counts) == total and min(counts) >= 1
    assert apportion(total, weights) == counts
    # Largest remainder never strays a whole layer from a node's exact quota unless the minimum forced it.
    share = [Fraction(total) * Fraction(w) / sum(Fraction(x) for x in weights) for w in weights]
    if all(q >= 1 for q in share):
        assert all(abs(c - q) < 1 for c, q in zip(counts, share))


def test_apportion_worked_examples():
    assert apportion(28, [1, 1, 1]) == [10, 9, 9] == even_split(28, 3)
    assert apportion(32, [48, 16]) == [24, 8]
    assert apportion(10, [1000, 1, 1]) == [8, 1, 1]  # the minimum of one layer each
    assert apportion(5, [1, 1]) == [3, 2]  # ties to the earlier node
    assert apportion(3, [0, 0, 0]) == [1, 1, 1]


def test_equal_nodes_split_evenly():
    cost = _flat(28, layer=GIB // 4, embed=GIB // 8, norm=1024)
    for budgets in (None, [20 * GIB] * 3):
        nodes = _nodes(3, budgets)
        for strategy in ("uniform", "balanced", "memory", "compute"):
            assert place(strategy, nodes, cost) == [10, 9, 9], strategy
    plan = plan_for(7, "node0", "fp", _nodes(3), cost)
    assert plan.split == [10, 9, 9] and plan.term == 7 and plan.leader == "node0"


def test_memory_follows_budgets():
    cost = _flat(32, layer=GIB, embed=GIB // 4, norm=1 << 20, head=GIB // 4)
    nodes = _nodes(2, budgets=[48 * GIB, 16 * GIB])
    assert place("memory", nodes, cost) == [24, 8]
    # No limit shares like the roomiest limited node.
    assert place("memory", _nodes(3, budgets=[48 * GIB, 16 * GIB, None]), _flat(28)) == [12, 4, 12]
    assert place("memory", _nodes(2, budgets=[None, None]), _flat(9)) == [5, 4]


def test_compute_follows_speed():
    nodes = _nodes(2, speeds=[200.0, 100.0])
    assert place("compute", nodes, _flat(30)) == [20, 10]
    assert place("balanced", nodes, _flat(30)) == [20, 10]
    assert place("compute", _nodes(3, speeds=[1.0, 2.0, 1.0]), _flat(16)) == [4, 8, 4]


def test_custom_follows_proportions():
    nodes = _nodes(3, proportions=[1, 2, 1])
    assert place("custom", nodes, _flat(16)) == [4, 8, 4]
    with pytest.raises(PlacementError, match="node1"):
        place("custom", _nodes(2, proportions=[1.0, None]), _flat(16))
    with pytest.raises(PlacementError, match="node0"):
        place("custom", _nodes(2, proportions=[0.0, 1.0]), _flat(16))


def test_balanced_trades_speed_for_memory():
    # node0 is four times as fast but can hold only 10 one-byte layers.
    nodes = _nodes(2, budgets=[10, None], speeds=[4.0, 1.0])
    assert place("compute", _nodes(2, speeds=[4.0, 1.0]), _flat(30)) == [24, 6]
    assert place("balanced", nodes, _flat(30)) == [10, 20]
    # Proportional strategies clip to what fits rather than fail.
    assert place("compute", nodes, _flat(30)) == [10, 20]


def test_balanced_is_not_fooled_by_a_big_layer():
    # Greedy "take the most you can" gives node0 two layers and node1 the 100-byte one.
    cost = ModelCost((1, 1, 100, 1), 0, 0, 0)
    nodes = _nodes(3, budgets=[1000, 2, 200])
    assert place("balanced", nodes, cost) == [1, 1, 2]


def test_api_only_nodes_hold_nothing():
    nodes = _nodes(3, api_only={1})
    assert place("uniform", nodes, _flat(28)) == [14, 0, 14]
    plan = plan_for(1, "node1", "fp", nodes, _flat(28))
    assert [s.node for s in plan.stages] == ["node0", "node2"]
    assert plan.leader == "node1" and plan.index_of("node1") is None
    with pytest.raises(PlacementError, match="api_only"):
        place("balanced", _nodes(2, api_only={0, 1}), _flat(4))


def test_too_many_nodes_and_unknown_strategy():
    with pytest.raises(PlacementError, match="3 nodes cannot each hold a layer"):
        place("balanced", _nodes(3), _flat(2))
    assert place("balanced", _nodes(3, api_only={2}), _flat(2)) == [1, 1, 0]
    with pytest.raises(PlacementError, match="unknown placement strategy"):
        place("fastest", _nodes(2), _flat(4))
    with pytest.raises(PlacementError, match="speed"):
        place("balanced", _nodes(2, speeds=[1.0, 0.0]), _flat(4))


def test_explicit_split_overrides_and_is_checked():
    nodes = _nodes(3, api_only={0})
    assert place("balanced", nodes, _flat(10), split=[7, 3]) == [0, 7, 3]
    assert plan_for(1, "node0", "fp", nodes, _flat(10), split=[7, 3]).split == [7, 3]
    with pytest.raises(PlacementError, match="2 entries for the 3 node"):
        place("uniform", _nodes(3), _flat(10), split=[5, 5])
    with pytest.raises(PlacementError, match="sums to 9"):
        place("uniform", _nodes(2), _flat(10), split=[5, 4])
    with pytest.raises(PlacementError, match="at least one"):
        place("uniform", _nodes(2), _flat(10), split=[10, 0])
    with pytest.raises(PlacementError, match=r"node1 needs .* short by"):
        place("uniform", _nodes(2, budgets=[None, 3]), _flat(10), split=[5, 5])


def test_a_model_too_big_names_every_short_node():
    cost = _flat(32, layer=GIB, embed=GIB // 2, head=GIB // 2, kv=GIB // 8)
    nodes = _nodes(3, budgets=[8 * GIB, 8 * GIB, 8 * GIB])
    for strategy in STRATEGIES[:-1]:
        with pytest.raises(PlacementError) as e:
            place(strategy, nodes, cost)
        text = str(e.value)
        for node in ("node0", "node1", "node2"):
            assert f"{node} needs" in text, text
        assert "short by" in text and "does not fit" in text
        assert "budgets add up to 24.00 GiB" in text, text  # the ring's total, too
    # Tiny models: MiB where GiB would read 0.00.
    with pytest.raises(PlacementError, match=r"MiB\).*short by"):
        place("balanced", _nodes(2, budgets=[1 << 20, 1 << 20]), _flat(4, layer=1 << 20))
    # Enough in total but not in any contiguous split.
    with pytest.raises(PlacementError, match="no contiguous split"):
        place("balanced", _nodes(2, budgets=[1, 1000]), ModelCost((500, 2), 0, 0, 0))


def test_an_api_only_leader_holds_no_layers_and_serves_the_ring(tiny_model, tmp_path):
    """Real daemons: node0 leads and serves the API with no layers; node1 and node2 hold them all."""
    import json
    import urllib.request

    from devkit.cluster import Cluster
    from devkit.reference import reference

    class FrontDoor(Cluster):
        def flags(self, i, secret=None, name=None):
            return {**super().flags(i, secret, name), "api_only": True if i == 0 else None}

    model = tiny_model(arch="llama", layers=6)
    c = FrontDoor(model, 3, tmp_path)
    try:
        status = c.wait(lambda: (s := c.status(0)) and s.get("ready") and s, 60, "a ring behind the API-only leader")
        assert status["leader"] == "node0" and [s[0] for s in status["plan"]["stages"]] == ["node1", "node2"]
        assert next(n for n in status["nodes"] if n["node"] == "node0")["parameter_bytes"] == 0
        prompt = [(i * 37) % 500 + 3 for i in range(20)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(c.url(0) + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            tokens = [int(t.removeprefix("token_id:")) for t in json.loads(r.read())["choices"][0]["logprobs"]["tokens"]]
        assert tokens == reference(model, prompt, 30)[0]
    finally:
        c.stop()


# --- tensor-parallel groups -------------------------------------------------------


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(2, 4), st.data())
def test_grouped_plans_round_trip_and_name_every_member_once(split, size, data):
    heads = [(f"node{i * size}", f"127.0.0.1:{5000 + i}") for i in range(len(split))]
    groups = {h: tuple((f"node{i * size + j}", f"127.0.0.1:{6000 + i * size + j}") for j in range(1, size)) for i, (h, _) in enumerate(heads)}
    plan = with_groups(make_plan(1, "node0", "fp", sum(split), heads, split), groups)
    assert Plan.from_wire(plan.to_wire()) == plan
    assert plan.nodes == tuple(f"node{i}" for i in range(len(split) * size))
    member = data.draw(st.sampled_from(plan.nodes))
    i = plan.index_of(member)
    assert member in plan.stages[i].members and plan.stages[i].members[0] == heads[i][0]


def test_a_plan_naming_a_node_in_two_groups_or_a_malformed_group_is_refused():
    plan = make_plan(1, "a", "fp", 4, [("a", "h:1"), ("c", "h:3")], [2, 2])
    doc = with_groups(plan, {"a": (("b", "h:2"),), "c": (("d", "h:4"),)}).to_wire()
    assert Plan.from_wire(doc).nodes == ("a", "b", "c", "d")
    doc["stages"][1][4] = [["b", "h:2"]]
    with pytest.raises(PlacementError, match="twice"):
        Plan.from_wire(doc)
    for bad in ([], [["b"]], [["b", 5]], "b", [["b", "h:2"]] * 16):
        doc["stages"][1][4] = bad
        with pytest.raises(PlacementError):
            Plan.from_wire(doc)


def test_groups_form_from_consecutive_holders_each_placed_as_one_node():
    nodes = [NodeSpec("a", "h:1", 4 * GIB, 1.0), NodeSpec("b", "h:2", 2 * GIB, 0.5), NodeSpec("x", "h:9", None, api_only=True),
             NodeSpec("c", "h:3", None, 1.0), NodeSpec("d", "h:4", 8 * GIB, 1.0), NodeSpec("e", "h:5", 8 * GIB, 1.0)]  # fmt: skip
    placed, groups, left = tensor_groups(nodes, 2)
    assert groups == {"a": (("b", "h:2"),), "c": (("d", "h:4"),)}
    assert [(n.node, n.budget, n.speed, n.api_only) for n in placed] == [("x", None, 1.0, True), ("a", 2 * GIB, 1.0, False), ("c", 8 * GIB, 2.0, False)]
    assert [n for n, _ in left] == ["e"] and "tensor-parallel groups of 2" in left[0][1]
    with pytest.raises(PlacementError, match="at least 3 nodes"):
        tensor_groups(nodes[:2], 3)


@given(st.lists(st.integers(1, 10**9), min_size=1, max_size=6), st.integers(0, 10**9), st.integers(0, 10**6), st.integers(1, 8))
def test_a_member_holds_a_slice_of_each_layer_and_the_ends_whole(layers, embed, kv, size):
    cost = ModelCost(tuple(layers), embed, 7, 0, kv)
    member = cost.per_member(size)
    n = len(layers)
    assert member.stage_need(0, n) >= cost.stage_need(0, n) / size
    assert member.stage_need(0, n) - (embed + 7 + 0) <= (cost.stage_need(0, n) - embed - 7) / size + 2 * n
    assert member.stage_bytes(0, n) >= embed + 7
