"""metrics.py: histograms observed where things happen, gauges read at scrape time, live figures."""

from __future__ import annotations

import socket
import urllib.request

import openai
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringd.base.metrics import LIVE_WINDOW_S, Gauges, Live, Metrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus text exposition: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(all_: dict, name: str, **labels) -> float:
    return all_.get((name, tuple(sorted(labels.items()))), 0.0)


def test_gauges_are_read_from_the_parts_at_each_scrape():
    held = Gauges(ready=True, leading=True, sessions=2, kv_bytes=4096, kv_capacity=None, budget=1 << 30, leader_changes=3)
    m = Metrics("mini1", lambda: held)
    first = samples(generate_latest(m.registry).decode())
    assert value(first, "ringd_ready", node="mini1") == 1.0
    assert value(first, "ringd_sessions", node="mini1") == 2.0
    assert value(first, "ringd_kv_bytes", node="mini1") == 4096.0
    assert value(first, "ringd_budget", node="mini1") == float(1 << 30)
    assert ("ringd_kv_capacity", (("node", "mini1"),)) not in first  # unknown is absent, not 0
    assert value(first, "ringd_leader_changes_total", node="mini1") == 3.0  # counts are counters
    assert value(first, "ringd_process_resident_memory_bytes", node="mini1") > 0
    assert value(first, "ringd_mlx_peak_memory_bytes", node="mini1") >= value(first, "ringd_mlx_active_memory_bytes", node="mini1")
    held = Gauges(sessions=5)
    assert value(samples(generate_latest(m.registry).decode()), "ringd_sessions", node="mini1") == 5.0


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=200))
def test_live_tokens_per_second_counts_only_the_window(gaps):
    live, now = Live(), 1000.0
    for g in gaps:
        now += g
        live.token(now)
    rate = live.tokens_per_s(now)
    recent = sum(1 for t in live._tokens)  # what is left after the window was applied
    assert rate >= 0
    assert all(t >= now - LIVE_WINDOW_S for t in live._tokens)
    if recent < 2:
        assert rate == 0.0
    assert live.tokens_out_total == len(gaps)


def test_live_keeps_only_the_windows_tokens_when_nobody_reads_it():
    # A leader nobody watches (no dashboard, no top) streams for hours: memory stays one window's.
    live, per_s = Live(), 100
    for i in range(int(60 * LIVE_WINDOW_S) * per_s):
        live.token(i / per_s)
    assert len(live._tokens) <= LIVE_WINDOW_S * per_s + 1
    assert live.tokens_out_total == int(60 * LIVE_WINDOW_S) * per_s


def test_live_ttft_is_the_median_of_recent_requests():
    m = Metrics("mini1")
    assert m.stats(0, 0)["ttft_s"] is None
    for s in (0.1, 0.3, 0.2):
        m.first_token(s)
    stats = m.stats(active=2, queued=1)
    assert stats["ttft_s"] == 0.2 and stats["requests_total"] == 3
    assert (stats["active_requests"], stats["queued_requests"]) == (2, 1)


# --- on a ring -------------------------------------------------------------------------


def scrape(c, i: int) -> dict:
    with urllib.request.urlopen(c.url(i) + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return samples(r.read().decode())


def hist_count(all_: dict, name: str, node: str, **labels) -> float:
    return value(all_, name + "_count", node=node, **labels)


def test_five_completions_are_in_the_leaders_histograms_and_every_stages(observed_ring):
    c = observed_ring
    leader = c.wait(lambda: c.leader_ready(0), 60, "a ready ring")
    li = int(leader[len("node") :])
    before = {i: scrape(c, i) for i in range(3)}
    client = openai.OpenAI(base_url=c.url(li) + "/v1", api_key="x", max_retries=0, timeout=120)
    produced = []
    for k in range(5):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Count to {k + 3} in a long sentence."}], max_tokens=4 + k, temperature=0
        )
        produced.append(r.usage.completion_tokens)
    gaps = sum(n - 1 for n in produced)

    def moved(i: int, name: str, **labels) -> float:
        return hist_count(after[i], name, f"node{i}", **labels) - hist_count(before[i], name, f"node{i}", **labels)

    def settled():
        nonlocal after
        after = {i: scrape(c, i) for i in range(3)}
        return all(moved(i, "ringd_stage_compute_seconds", phase="decode") >= sum(produced) for i in range(3))

    after: dict = {}
    c.wait(settled, 60, "every stage to count its decode frames")
    assert moved(li, "ringd_time_to_first_token_seconds") == 5
    assert moved(li, "ringd_inter_token_latency_seconds") == gaps
    assert moved(li, "ringd_request_duration_seconds") == 5
    assert moved(li, "ringd_queue_wait_seconds") == 5
    for i in range(3):
        # One decode frame per generated token on every stage (the last prompt token, then
        # each token fed back but the last), and prompt chunks before them.
        assert moved(i, "ringd_stage_compute_seconds", phase="decode") == sum(produced), i
        assert moved(i, "ringd_stage_compute_seconds", phase="prefill") >= 1, i
        assert value(after[i], "ringd_stage_compute_seconds_sum", node=f"node{i}", phase="decode") > 0
    # Frames left every node that passes them on (a stage handing its output to the next).
    assert all(moved(i, "ringd_link_send_seconds") > 0 for i in range(3))
    n = f"node{li}"
    ok = ("/v1/chat/completions", "200")
    requests = value(after[li], "ringd_requests_total", node=n, endpoint=ok[0], status=ok[1]) - value(
        before[li], "ringd_requests_total", node=n, endpoint=ok[0], status=ok[1]
    )
    assert requests == 5
    assert value(after[li], "ringd_completion_tokens_total", node=n) - value(before[li], "ringd_completion_tokens_total", node=n) == sum(produced)
    assert value(after[li], "ringd_prompt_tokens_total", node=n) > value(before[li], "ringd_prompt_tokens_total", node=n)
    assert value(after[li], "ringd_plan_changes_total", node=n) >= 1
    # Live figures for the dashboard: the leader's recent time to first token.
    assert c.status(li)["nodes"][0]["stats"]["ttft_s"] > 0


GAUGES_IN_STATUS = {
    "ringd_sessions": "sessions",
    "ringd_kv_bytes": "kv_bytes",
    "ringd_kv_capacity": "kv_capacity",
    "ringd_parameter_bytes": "parameter_bytes",
    "ringd_budget": "budget",
    "ringd_active_requests": "active_requests",
    "ringd_queued_requests": "queued_requests",
    "ringd_prefix_entries": "prefix_entries",
}


def test_the_collectors_gauges_match_cluster_status(observed_ring):
    c = observed_ring
    c.wait(lambda: c.leader_ready(0), 60, "a ready ring")

    def matching():
        for i in range(3):
            status = next(n for n in c.status(i)["nodes"] if n["node"] == f"node{i}")
            got = scrape(c, i)
            node = f"node{i}"
            want = {m: status[k] for m, k in GAUGES_IN_STATUS.items() if status[k] is not None}
            want["ringd_ready"] = float(status["ready"])
            want["ringd_leading"] = float(status["role"] == "leader")
            want["ringd_linked_peers"] = len(status["peers"])
            want["ringd_task_restarts_total"] = sum(status["task_restarts"].values())
            if any(value(got, m, node=node) != v for m, v in want.items()):
                return False
            assert status["parameter_bytes"] > 0 and value(got, "ringd_mlx_active_memory_bytes", node=node) >= status["parameter_bytes"]
        return True

    c.wait(matching, 60, "the gauges of every node to match its status")


def test_a_failed_handshake_is_counted(observed_ring):
    c = observed_ring
    kind = {"node": "node2", "kind": "failed handshakes"}
    before = value(scrape(c, 2), "ringd_ring_peer_events_total", **kind)
    with socket.create_connection(("127.0.0.1", c.ring_ports[2]), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)  # not a ringd hello
        s.recv(1)  # returns when the node hangs up on it
    c.wait(lambda: value(scrape(c, 2), "ringd_ring_peer_events_total", **kind) == before + 1, 30, "the failed handshake to be counted")


def test_the_heartbeat_loop_counts_its_rounds(observed_ring):
    """ringd_heartbeats_total rises while a node runs: the loop that pings peers and declares the
    silent ones dead is alive (tests read it to know dead_after_s has been checked past a moment)."""
    c = observed_ring
    before = [value(scrape(c, i), "ringd_heartbeats_total", node=f"node{i}") for i in range(3)]
    assert all(b > 0 for b in before), before
    c.wait(lambda: all(value(scrape(c, i), "ringd_heartbeats_total", node=f"node{i}") >= before[i] + 2 for i in range(3)), 60, "two more heartbeat rounds on every node")
