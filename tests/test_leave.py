"""A node that stops takes nothing down with it: leaving is a protocol step, not a crash.

Real `ringd serve` processes and real signals, as launchd (SIGTERM at shutdown,
`ringctl uninstall`) and a user (Ctrl-C: SIGINT to every process of `ringd local`)
send them, with streams open through the node that stops. A node that stops says
LEAVE on its links, ends what it serves and forwards with an error event and
``data: [DONE]`` (a leader's forwarded streams move to the next leader instead),
and exits 0 within seconds; the rest re-plan once, at once, without waiting for
heartbeats to time out. A whole ring stopped at once ends quiet: no re-planning,
no election, exit 0 everywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from devkit import REPO, TEST_PREFILL_CHUNK
from devkit.cluster import Cluster
from devkit.clients import Stream
from devkit.cluster import serving_leader

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me everything about rings."}]
# Long enough that the stream is still running when the signal lands.
STREAM_TOKENS = 2000
# A stream that runs to its end across the leader's leaving: still running when the signal lands
# (after its 40th chunk), and hundreds of tokens carried over to the next leader.
CARRIED_TOKENS = 400
# "Within seconds": what a leaving node may take to end its streams, close its
# links and exit, on a loaded two-core machine.
EXIT_DEADLINE_S = 15.0
# Lines that must not follow a whole-ring stop: re-planning, elections.
NOISE = ("ring down", "leading the cluster", "following ", "re-planning", "plan term", "declaring it dead")
WHOLE_RING_ROUNDS = 4


def exit_code(c: Cluster, i: int, timeout: float = EXIT_DEADLINE_S) -> int | None:
    try:
        return c.procs[i].wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def log_after(c: Cluster, i: int, offset: int) -> str:
    return c.logs[i].read_text(errors="replace")[offset:]


def log_sizes(c: Cluster) -> dict[int, int]:
    return {i: c.logs[i].stat().st_size for i in c.logs}


def heartbeats(c: Cluster, i: int) -> float:
    """Rounds of node i's heartbeat loop (``ringd_heartbeats_total``): each declares dead the peers silent too long."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(c.url(i) + "/metrics", timeout=10).read().decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "ringd_heartbeats"]
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def past_dead_after(c: Cluster, i: int, since: float) -> None:
    """Return once node i's heartbeat loop, which declares silent peers dead, has run two rounds
    past ``since`` + dead_after_s. Only then does a dead peer's absence from its log prove anything."""
    from ringd.cluster.links import DEAD_AFTER_S

    c.wait(lambda: time.monotonic() > since + DEAD_AFTER_S, 60, "dead_after_s to pass")
    base = heartbeats(c, i)
    c.wait(lambda: heartbeats(c, i) >= base + 2, 60, f"node{i}'s heartbeat loop to run past dead_after_s")


@pytest.fixture
def model(tiny_model):
    return tiny_model(arch="llama", layers=6)


def test_sigterm_of_a_follower_forwarding_a_stream(model, cluster_factory):
    c = cluster_factory(model, 3)
    c.wait(lambda: serving_leader(c, range(3)) == "node0", what="node0 to lead")
    term = c.status(0)["plan"]["term"]
    via_follower = Stream(c.url(2), MESSAGES, STREAM_TOKENS)
    direct = [Stream(c.url(0), MESSAGES, 60) for _ in range(2)]  # the leader is busy
    via_follower.wait_started()
    before = log_sizes(c)
    left = time.monotonic()
    c.procs[2].send_signal(signal.SIGTERM)
    assert exit_code(c, 2) == 0, f"the follower did not exit 0 within {EXIT_DEADLINE_S} s\n{c.log_tails()}"
    # Its stream ended as a stream should: an error event saying why, then [DONE].
    assert via_follower.join(30) and via_follower.clean, via_follower
    assert via_follower.error and "stopping" in via_follower.error["message"], via_follower.error
    # The leader heard it leave, re-planned once over the other two, and serves on.
    c.wait(lambda: (s := c.status(0)) and s.get("ready") and s["plan"]["term"] > term, 30, "the leader to serve on two nodes")
    for s in direct:
        assert s.join(60) and s.clean and s.error is None, s
    after = Stream(c.url(0), MESSAGES, 20)
    assert after.join(60) and after.clean and after.error is None and after.text, after
    past_dead_after(c, 0, left)
    leader_log = log_after(c, 0, before[0])
    assert "node2 is leaving" in leader_log, leader_log[-3000:]
    assert leader_log.count("coordinator: plan term") == 1, leader_log  # one re-plan, no storm
    assert "declaring it dead" not in leader_log and "ring down" not in leader_log
    # The leaver neither dialed, nor ran for leader, nor retried its own port.
    leaver_log = log_after(c, 2, before[2])
    for line in ("leading the cluster", "linked with", "forwarding", "carrying it over"):
        assert line not in leaver_log, leaver_log


def test_sigterm_of_the_leader_moves_streams_through_followers_to_the_next(model, cluster_factory):
    c = cluster_factory(model, 3)
    c.wait(lambda: serving_leader(c, range(3)) == "node0", what="node0 to lead")
    whole = Stream(c.url(2), MESSAGES, CARRIED_TOKENS)
    assert whole.join(120) and whole.clean and whole.finish == "length", whole
    through = Stream(c.url(2), MESSAGES, CARRIED_TOKENS)
    through.wait_started(40)
    before = log_sizes(c)
    left = time.monotonic()
    c.procs[0].send_signal(signal.SIGTERM)
    assert exit_code(c, 0) == 0, f"the leader did not exit 0 within {EXIT_DEADLINE_S} s\n{c.log_tails()}"
    assert through.join(120) and through.clean and through.error is None, through
    assert through.text == whole.text, "the stream carried over to the next leader differs from the uninterrupted run"
    assert c.wait(lambda: serving_leader(c, [1, 2]), 30, "the others to elect and serve") == "node1"
    for i in (1, 2):
        past_dead_after(c, i, left)
    assert "node0 is leaving" in log_after(c, 1, before[1])
    assert "declaring it dead" not in log_after(c, 1, before[1]) + log_after(c, 2, before[2])


@pytest.mark.parametrize("round_", range(WHOLE_RING_ROUNDS))
def test_sigint_to_every_node_at_once_ends_quiet(model, cluster_factory, round_):
    c = cluster_factory(model, 3)
    c.wait(lambda: serving_leader(c, range(3)) == "node0", what="node0 to lead")
    streams = [Stream(c.url(0), MESSAGES, STREAM_TOKENS), Stream(c.url(1 + round_ % 2), MESSAGES, STREAM_TOKENS)]
    for s in streams:
        s.wait_started()
    before = log_sizes(c)
    for p in c.procs.values():
        p.send_signal(signal.SIGINT)
    codes = [exit_code(c, i) for i in range(3)]
    assert codes == [0, 0, 0], f"exit codes {codes}\n{c.log_tails()}"
    for s in streams:
        assert s.join(30) and s.clean, s
    for i in range(3):
        after = log_after(c, i, before[i])
        noisy = [line for line in after.splitlines() if any(n in line for n in NOISE)]
        assert not noisy, f"node{i} after the signal:\n" + "\n".join(noisy)


def test_ctrl_c_of_ringd_local_stops_every_node_quietly(model, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the launcher and every node (one process group)."""
    log = tmp_path / "local.log"
    env = {**os.environ, "RINGD_PREFILL_CHUNK_TOKENS": str(TEST_PREFILL_CHUNK)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringd", "local", "--nodes", "3", "--model", str(model), "--port", "0", "--model-id", "tiny"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "OpenAI API at " not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = log.read_text().split("OpenAI API at ", 1)[1].split()[0].removesuffix("/v1")
        stream = Stream(url, MESSAGES, STREAM_TOKENS)
        stream.wait_started()
        offset = len(log.read_text())
        os.killpg(proc.pid, signal.SIGINT)
        # Then more, to the launcher alone, until it has exited: a second Ctrl-C, or `uv run`
        # passing the terminal's on (it does), must not turn a clean stop into a death by SIGINT.
        deadline = time.monotonic() + EXIT_DEADLINE_S + 10
        while proc.poll() is None and time.monotonic() < deadline:
            os.kill(proc.pid, signal.SIGINT)  # not reaped until poll() says so: never another's pid
            time.sleep(0.01)
        # 0: the ring was serving when the signal came (130 is for one stopped while it got ready).
        assert proc.wait(10) == 0, log.read_text()[-3000:]
        assert stream.join(30) and stream.clean, stream
        after = log.read_text()[offset:]
        noisy = [line for line in after.splitlines() if any(n in line for n in NOISE) or "exited with code" in line]
        assert not noisy, "after Ctrl-C:\n" + "\n".join(noisy)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
