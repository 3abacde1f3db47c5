"""The ring over links as Macs have them (--link), its plumbing: each node a network namespace host
(devkit/netns.py) whose one interface is an emulated link of a profile (devkit/linkshape.py:
latency, jitter, loss, rate; the kernel here has no netem), a thread moved into a host's
namespace, TCP round trips between two hosts, ``ringd serve`` started on every host, and what
its plan says (term, hops). Root only: network namespaces are root's to make."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from devkit import REPO
from devkit.bench.rings import cluster_status, ring_decode
from devkit.bench.theory import hops_per_token

# Every host has ports of its own: the daemons take ringd's defaults, the echo its own.
LINK_RING_PORT = 50051
LINK_HTTP_PORT = 8100
LINK_ECHO_PORT = 9000

# Round trips per link measurement: enough that Wi-Fi's 0.5% loss per crossing (a lost segment
# is resent after a TCP timeout of ~200 ms) shows in the mean about as often as it does to a ring;
# a thousand Wi-Fi round trips take ~5 s. The first ones (the connection's slow start) are dropped.
LINK_ROUND_TRIPS = 1000
LINK_WARM_ROUND_TRIPS = 20

# Loading the tiny model and linking over a Wi-Fi link takes seconds; this long means stuck.
LINK_RING_READY_TIMEOUT_S = 180.0
LINK_RING_POLL_S = 0.2

# Warm-ups a ring over links gets to run one on one plan; a re-plan or two at the start is the
# most ever seen, more means it keeps breaking.
LINK_SETTLE_TRIES = 5

# setns(2)'s flag for a network namespace (<sched.h>); os.setns is Python 3.12's, this is 3.11.
CLONE_NEWNET = 0x40000000
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(65536)):
    c.sendall(d)
"""
_PING = """
import json, socket, sys, time
host, port, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = socket.create_connection((host, port), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
message, rtts = b"x" * size, []
for _ in range(count):
    t = time.perf_counter()
    c.sendall(message)
    got = 0
    while got < size:
        got += len(c.recv(size - got))
    rtts.append(time.perf_counter() - t)
print(json.dumps(rtts))
"""


@contextlib.contextmanager
def in_netns(name: str):
    """This thread in network namespace ``name`` meanwhile (and the threads it starts, as a
    ThreadPoolExecutor's): the sockets it opens are that host's."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns back to this process's network namespace: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(there)
        os.close(home)


def link_round_trips(net, a: int, b: int, size: int) -> list[float]:
    """Seconds per TCP round trip of a ``size``-byte message from host ``a`` to an echo on host
    ``b`` and back (as tests/test_linkshape.py measures a link), after the warm-up's."""
    host = net.hosts[b].ip
    echo = net.popen(b, [sys.executable, "-c", _ECHO, host, str(LINK_ECHO_PORT)], stdout=subprocess.PIPE)
    try:
        if echo.stdout.readline().strip() != b"listening":
            raise SystemExit(f"bench: the echo on {host} did not start")
        count = LINK_WARM_ROUND_TRIPS + LINK_ROUND_TRIPS
        out = subprocess.run(
            net.exec_prefix(a) + [sys.executable, "-c", _PING, host, str(LINK_ECHO_PORT), str(size), str(count)],
            capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
    finally:
        echo.kill()
        echo.wait()
        echo.stdout.close()
    return json.loads(out.stdout)[LINK_WARM_ROUND_TRIPS:]


def link_profile(name: str):
    """A profile of devkit/linkshape.py by name, or ``none``: a link of no latency, loss or rate
    limit, through the emulator all the same (its own cost to a ring, a control for the others)."""
    from devkit import linkshape

    if name == "none":
        return linkshape.Profile("none", 0.0, 0.0, 0.0, 1e12, 9000)
    return linkshape.profile(name)


def emulator_one_way_s(size: int) -> tuple[float, float]:
    """Median one-way seconds of a ``size``-byte message between two namespace hosts joined by a
    plain bridge, and joined through the link emulator with a link of no latency: the second
    less the first is what the emulator itself adds to each crossing."""
    from statistics import median

    from devkit.netns import NetnsHosts

    out = []
    for links in (None, [link_profile("none")] * 2):
        with NetnsHosts(2, links=links) as net:
            out.append(median(link_round_trips(net, 0, 1, size)) / 2)
    return out[0], out[1]


def start_link_ring(net, model_path: str, workdir: Path) -> tuple[list[subprocess.Popen], str]:
    """One ``ringd serve`` per host of ``net``, each dialing the others by IP (no mDNS), started as
    ``ringd local`` starts its nodes; node0 leads (the smallest name). The leader's API URL,
    reachable from inside host 0's namespace once the ring is ready."""
    import secrets

    from ringd.base.servecmd import serve_command

    n = len(net.hosts)
    secret = workdir / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    cluster = f"bench-{secrets.token_hex(4)}"
    env = dict(os.environ, RINGD_EXIT_WITH_PARENT=str(os.getpid()))
    procs = []
    for i, host in enumerate(net.hosts):
        cmd = serve_command(
            name=f"node{i}", host=host.ip, advertise=host.ip, ring_port=LINK_RING_PORT,
            http_host=host.ip, http_port=LINK_HTTP_PORT, model=model_path, model_id="bench", secret_file=secret, cluster=cluster,
            state_dir=workdir, nodes=n, discovery=False, log_level="warning",
            peer=[f"{other.ip}:{LINK_RING_PORT}" for j, other in enumerate(net.hosts) if j != i],
        )  # fmt: skip
        procs.append(net.popen(i, cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL))
    url = f"http://{net.hosts[0].ip}:{LINK_HTTP_PORT}"
    deadline = time.monotonic() + LINK_RING_READY_TIMEOUT_S
    with in_netns(net.hosts[0].name):
        while time.monotonic() < deadline:
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                raise SystemExit(f"bench: node{dead[0]} of the ring over links exited with code {procs[dead[0]].returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return procs, url
            except OSError:
                pass  # not listening yet, or 503 while the ring forms
            time.sleep(LINK_RING_POLL_S)
    raise SystemExit(f"bench: the {n}-node ring over links was not ready within {LINK_RING_READY_TIMEOUT_S:.0f} s")


def plan_term(url: str) -> int:
    return cluster_status(url).plan["term"]


def settle(url: str, prompt: list[int], no_eos: list[int]) -> None:
    """Warm the ring up until a warm-up runs on one plan from start to end: a ring just linked
    over slow links may re-plan once as both ends' dials settle which link to keep (cluster/links.py)."""
    for _ in range(LINK_SETTLE_TRIES):
        term = plan_term(url)
        ring_decode(url, prompt, 8, no_eos)  # first-use allocations on every stage, too
        if plan_term(url) == term:
            return
    raise SystemExit(f"bench: the ring over links re-planned during each of {LINK_SETTLE_TRIES} warm-ups; it never settled")


def ring_hops(url: str) -> int:
    """Links a decode step crosses on the ring at ``url``, from its plan."""
    plan = cluster_status(url).plan
    return hops_per_token(plan["leader"], [s[0] for s in plan["stages"]])
