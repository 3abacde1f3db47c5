"""ringd.cluster.topology: ring order and exclusion by link cost, property-tested (pure functions)."""

from __future__ import annotations

import itertools

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from devkit.linkshape import Profile

from ringd.cluster.linkcost import Measured
from ringd.cluster.topology import (
    MAX_EXACT_NODES,
    REPLAN_FLOOR_US,
    Layout,
    choose,
    link_matrix,
    ring_cost,
)
from ringd.base.names import natural_key

WIRED_US, WIFI_US = 150, 4000  # RTTs: a wired mini's links, a Wi-Fi laptop's


def names(n: int) -> list[str]:
    return [f"node{i}" for i in range(1, n + 1)]


def by_rtt(rtts: dict[tuple[str, str], int]) -> dict[frozenset[str], Measured]:
    return {frozenset(p): Measured(r) for p, r in rtts.items()}


def fits_with(budgets: dict[str, int], need: int):
    """fits(nodes): the model of ``need`` units fits when their budgets add up (a note), else None."""

    def fits(nodes):
        have = sum(budgets[n] for n in nodes)
        return f"needs {need} of {have}" if have >= need else None

    return fits


@st.composite
def clusters(draw, min_nodes=1, max_nodes=7):
    nodes = names(draw(st.integers(min_nodes, max_nodes)))
    pairs = list(itertools.combinations(nodes, 2))
    links = {}
    for a, b in pairs:
        if draw(st.booleans()) or draw(st.booleans()):  # most links measured, some not yet
            rate = draw(st.none() | st.integers(1_000_000, 5_000_000_000))
            links[frozenset((a, b))] = Measured(draw(st.integers(20, 20_000)), rate)
    budgets = {n: draw(st.integers(0, 10)) for n in nodes}
    need = draw(st.integers(0, sum(budgets.values())))
    leader = draw(st.sampled_from(nodes))
    holders = [n for n in nodes if n == leader or draw(st.integers(0, 5)) > 0]  # some may hold no layers
    return leader, holders, links, budgets, need


def test_a_wifi_mac_whose_memory_is_not_needed_is_left_out_and_says_why():
    nodes = names(4)
    rtts = {(a, b): (WIFI_US if "node4" in (a, b) else WIRED_US) for a, b in itertools.combinations(nodes, 2)}
    layout = choose("node1", nodes, by_rtt(rtts), fits_with(dict.fromkeys(nodes, 1), 3))
    assert layout.ring == ("node1", "node2", "node3") and layout.out == {"node4"}
    assert layout.left_out[0][1] == "node4 left out: its links average 4.00 ms against 0.15 ms (RTT), adding 3.92 ms a token, and the model fits on node1-node3 (needs 3 of 3)"
    assert [(a, b) for a, b, _ in layout.hops] == [("node1", "node2"), ("node2", "node3"), ("node3", "node1")]
    assert layout.cost_us == 3 * WIRED_US // 2


def test_a_wifi_mac_whose_memory_is_needed_stays_in():
    nodes = names(4)
    rtts = {(a, b): (WIFI_US if "node4" in (a, b) else WIRED_US) for a, b in itertools.combinations(nodes, 2)}
    layout = choose("node1", nodes, by_rtt(rtts), fits_with(dict.fromkeys(nodes, 1), 4))
    assert set(layout.ring) == set(nodes) and not layout.left_out


def test_the_order_avoids_a_slow_link():
    # node1-node2 and node3-node4 are slow (a Wi-Fi hop each way); name order crosses both.
    nodes = names(4)
    slow = {frozenset(("node1", "node2")), frozenset(("node3", "node4"))}
    links = {frozenset(p): Measured(3000 if frozenset(p) in slow else 200) for p in itertools.combinations(nodes, 2)}
    layout = choose("node1", nodes, links, fits_with(dict.fromkeys(nodes, 1), 4))
    assert layout.ring == ("node1", "node3", "node2", "node4")
    assert layout.cost_us == 4 * 100 < ring_cost("node1", tuple(nodes), links, nodes)
    # Kept once it runs (sticky); and a ring running in name order (as placed before links were
    # measured) is re-placed, the saving (2 x 1.4 ms) being over REPLAN_FLOOR_US and REPLAN_MARGIN.
    assert choose("node1", nodes, links, fits_with(dict.fromkeys(nodes, 1), 4), current=layout).ring == layout.ring
    assert choose("node1", nodes, links, fits_with(dict.fromkeys(nodes, 1), 4), current=Layout(tuple(nodes))).ring == layout.ring
    # Name order with no figures at all.
    assert choose("node1", nodes, {}, fits_with(dict.fromkeys(nodes, 1), 4)).ring == tuple(nodes)


def test_bandwidth_counts_a_hidden_state_s_time_on_the_wire():
    # Same RTT everywhere, but node2-node3 carries 8 KiB at 1 MB/s: 8 ms a hop.
    nodes = names(4)
    links = {frozenset(p): Measured(200, 1_000_000_000) for p in itertools.combinations(nodes, 2)}
    links[frozenset(("node2", "node3"))] = Measured(200, 1_000_000)
    layout = choose("node1", nodes, links, fits_with(dict.fromkeys(nodes, 1), 4), hop_bytes=8192)
    assert ("node2", "node3") not in [(a, b) for a, b, _ in layout.hops] and ("node3", "node2") not in [(a, b) for a, b, _ in layout.hops]


def test_link_matrix_takes_both_ends_rtt_mean_and_slower_bandwidth():
    m = link_matrix({"a": {"b": Measured(100, 5)}, "b": {"a": Measured(301, 9), "c": Measured(50)}, "c": {}})
    assert m == {frozenset("ab"): Measured(200, 5), frozenset("bc"): Measured(50, None)}


def placeable(c) -> tuple:
    """A drawn cluster whose holders hold the model between them (Hypothesis draws another where
    they do not): its leader, holders, links and ``fits``."""
    leader, holders, links, budgets, need = c
    fits = fits_with(budgets, need)
    assume(fits(tuple(holders)) is not None)
    return leader, holders, links, fits


def in_name_order(leader: str, nodes) -> tuple[str, ...]:
    """``nodes`` as rings were placed before links counted: the leader first if it is one, the rest by name."""
    return tuple(([leader] if leader in nodes else []) + sorted((n for n in nodes if n != leader), key=natural_key))


@given(clusters())
def test_the_chosen_ring_is_never_costlier_than_name_order_and_only_slow_macs_not_needed_are_out(c):
    leader, holders, links, fits = placeable(c)
    layout = choose(leader, holders, links, fits)
    # Every holder is in the ring or left out, once; the leader holds layers if it may, first.
    assert sorted(layout.ring + tuple(layout.out), key=natural_key) == sorted(holders, key=natural_key)
    assert leader not in layout.out
    assert layout.ring[0] == leader if leader in holders else True
    # A Mac whose memory is needed is never left out: what stays holds the model.
    assert fits(layout.ring) is not None
    # The cycle over the ring it kept is no costlier than that ring in name order.
    named = in_name_order(leader, layout.ring)
    assert layout.cost_us == ring_cost(leader, layout.ring, links, holders)
    assert layout.cost_us <= ring_cost(leader, named, links, holders)
    # Leaving Macs out never costs the cycle more than keeping every holder in name order.
    everyone = in_name_order(leader, holders)
    if not layout.left_out:
        assert layout.cost_us <= ring_cost(leader, everyone, links, holders)


@given(clusters(max_nodes=6))
def test_the_exact_order_is_the_cheapest_of_all_orders(c):
    leader, holders, links, fits = placeable(c)
    layout = choose(leader, holders, links, fits)
    rest = [n for n in layout.ring if n != leader]
    head = (leader,) if leader in layout.ring else ()
    cheapest = min(ring_cost(leader, head + p, links, holders) for p in itertools.permutations(rest))
    assert layout.cost_us == cheapest


@settings(max_examples=20)
@given(clusters(min_nodes=MAX_EXACT_NODES + 1, max_nodes=MAX_EXACT_NODES + 3))
def test_two_opt_beyond_the_exact_search_is_never_costlier_than_name_order(c):
    leader, holders, links, fits = placeable(c)
    layout = choose(leader, holders, links, fits)
    named = in_name_order(leader, layout.ring)
    assert layout.cost_us <= ring_cost(leader, named, links, holders)


@given(clusters(), st.data())
def test_a_layout_is_stable_under_jitter_within_the_margin(c, data):
    leader, holders, links, fits = placeable(c)
    first = choose(leader, holders, links, fits)
    # Every link's RTT and bandwidth moved by up to 10% (the margin allows 11%).
    jitter = st.floats(1 / 1.1, 1.1)
    moved = {
        p: Measured(max(1, round(m.rtt_us * data.draw(jitter))), None if m.bandwidth is None else max(1, round(m.bandwidth * data.draw(jitter))))
        for p, m in links.items()
    }
    again = choose(leader, holders, moved, fits, current=first)
    assert (again.ring, again.out) == (first.ring, first.out)


@given(clusters())
def test_a_running_layout_is_replaced_when_the_best_saves_more_than_the_margin(c):
    leader, holders, links, fits = placeable(c)
    best = choose(leader, holders, links, fits)
    # The running ring: every holder, in name order (as rings were placed before links counted).
    named = in_name_order(leader, holders)
    running = Layout(named)
    kept = choose(leader, holders, links, fits, current=running)
    if kept.ring == named and not best.left_out:
        # Kept: the best over the same Macs saves no more than the margin allows.
        assert kept.cost_us - best.cost_us <= max(REPLAN_FLOOR_US, 0.25 * kept.cost_us)


# --- over shaped links: five daemons, four wired in two rooms and one on Wi-Fi ------------------

# Run inside host 0's namespace: wait until the leader has left a Mac out and its ring crosses the
# backhaul no more than it must, then chat through the ring.
_NS_WAIT = r"""
import json, sys, time, urllib.request
url, within, segment = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}).encode()
deadline, last, failed = time.monotonic() + within, None, None
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url + "/cluster/status", timeout=5) as r:
            status = json.loads(r.read())
        layout = next((n.get("layout") for n in status["nodes"] if n.get("role") == "leader"), None)
        last = {"reason": status.get("reason"), "layout": layout}
        ring = layout["ring"] if layout else []
        crossings = sum(segment[a] != segment[b] for a, b in zip(ring, ring[1:] + ring[:1]))
        if status["ready"] and layout["left_out"] and crossings == 2:
            req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                chat = json.loads(r.read())
            print(json.dumps({"status": status, "chat": chat}))
            sys.exit(0)
    except Exception as e:
        failed = repr(e) + (e.read()[:300].decode(errors="replace") if hasattr(e, "read") else "")
    time.sleep(0.5)
print(json.dumps({"error": last, "failed": failed}))
sys.exit(1)
"""

# Two rooms, each with Macs on a Thunderbolt bridge, joined by a mesh Wi-Fi backhaul: 3 ms one way,
# so a ring that crosses it twice less saves 6 ms a token, over REPLAN_FLOOR_US and over
# REPLAN_MARGIN of the ring that crosses it four times even when reading beats adds 4 ms to each
# link's RTT (this VM's 2 shared cores read a Thunderbolt link as 2 ms).
BACKHAUL = Profile("mesh-backhaul", 3e-3, 0.2e-3, 0.0, 300e6, 1500)
# A laptop on a busy Wi-Fi (6 ms one way to a wired Mac): its links are judged against a typical
# link among the others, which now crosses the backhaul, so it must be slower than that by
# SLOW_LINK_FACTOR to be left out (the stock "wifi" profile, 1 ms to a wired Mac, is not).
BUSY_WIFI = Profile("busy-wifi", 12e-3, 2e-3, 0.005, 300e6, 1500)


def test_five_daemons_on_shaped_links_cross_the_backhaul_twice_leave_the_wifi_mac_out_and_ringctl_plan_says_why(tiny_model, tmp_path):
    """Four Macs in two rooms (host0 and host2 in one, host1 and host3 in the other: name order
    crosses the backhaul four times), a laptop on Wi-Fi in the first room (tests/kit/linkshape.py). The
    four wired Macs are all needed for the model, so once the leader has measured the links it
    orders them to cross the backhaul twice, the laptop holds no layers (it stays a member), and
    ringctl plan shows each hop's RTT and why the laptop is out. The first plan, before any link is
    measured, has all five in name order."""
    import json
    import os
    import re
    import subprocess
    import sys

    from devkit import REPO
    from devkit.netns import NetnsHosts, netns_available

    from ringd.models.source import model_info
    from ringd.ring.kvcost import KV_STEP_TOKENS

    reason = netns_available()
    assert reason is None, f"cannot build test hosts: {reason}"
    model = tiny_model(arch="llama", layers=6)
    # Each host may hold 0.3 of the model and a chat's KV cache (KV_STEP_TOKENS positions a layer, what a cache
    # allocates at once, reserved by placement): three cannot hold it, the four wired ones can.
    info = model_info(str(model))
    budget_gb = (info.weights.stage(0, 6) + 6 * KV_STEP_TOKENS * info.kv_bytes_per_token()) * 0.3 / 2**30
    secret = tmp_path / "secret"
    secret.write_text("w" * 32)
    secret.chmod(0o600)
    cluster = f"rooms-{os.getpid()}"
    segments = [0, 1, 0, 1, 0]
    segment = {f"host{i}": s for i, s in enumerate(segments)}
    with NetnsHosts(5, links=["thunderbolt"] * 4 + [BUSY_WIFI], segments=segments, uplink=BACKHAUL) as net:
        logs = [tmp_path / f"host{i}.log" for i in range(5)]
        for i in range(5):
            net.serve(
                i, logs[i], name=f"host{i}", cluster=cluster, secret_file=secret,
                model=model, model_id="tiny", state_dir=tmp_path / "state",
                memory_budget_gb=f"{budget_gb:.9f}", kv_reserve_tokens=KV_STEP_TOKENS,
            )  # fmt: skip
        api = f"http://{net.hosts[0].ip}:8100"
        wait = [sys.executable, "-c", _NS_WAIT, api, "120", json.dumps(segment)]
        done = subprocess.run(net.exec_prefix(0) + wait, capture_output=True, text=True, timeout=150)

        def tails() -> str:
            return "\n".join(f"--- host{i}\n{p.read_text()[-2500:]}" for i, p in enumerate(logs))

        assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{tails()}"
        result = json.loads(done.stdout)
        assert result["chat"]["choices"][0]["message"]["content"], tails()
        status = result["status"]
        layout = next(n["layout"] for n in status["nodes"] if n.get("role") == "leader")
        print(layout)
        assert [s[0] for s in status["plan"]["stages"]] == layout["ring"], status
        assert sorted(layout["ring"]) == ["host0", "host1", "host2", "host3"], layout
        # A hop across the backhaul is measured no faster than the backhaul both ways allows.
        for a, b, rtt_us, _ in layout["hops"]:
            if segment[a] != segment[b]:
                assert rtt_us >= 2 * (BACKHAUL.latency_s - BACKHAUL.jitter_s) * 1e6, layout
        plan = subprocess.run(
            net.exec_prefix(0) + [sys.executable, "-m", "ringd.app.ctl", "--node", f"{net.hosts[0].ip}:8100", "--secret-file", str(secret), "plan"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert plan.returncode == 0, plan.stderr
        print(plan.stdout)
        assert "host4 left out: its links average" in plan.stdout and "and the model fits on host0-host3 (needs" in plan.stdout, plan.stdout
        for a, b, _, _ in layout["hops"]:
            assert re.search(rf"{a} -> {b}: RTT \d+\.\d\d ms", plan.stdout), plan.stdout
