"""Bounded work per request: giant prompts refused before they cost, half-sent requests and the connection cap.

The cap itself is shown in-process on a real aiohttp server with a small cap;
the rest on a real `ringd serve` (a ring of one), measured from outside: its
RSS, whether it still leads, and how fast a normal request answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from ringd.http_guard import BodyBudget, listen, raise_fd_limit

GIANT_PROMPT_BYTES = 15 * 1024 * 1024
HALF_SENT = 2100


def post(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_connection_cap_refuses_the_one_too_many_and_says_so(caplog):
    async def main():
        app = web.Application()
        async def ok(request):
            return web.Response(text="ok")

        app.add_routes([web.get("/", ok)])
        runner = web.AppRunner(app)
        await runner.setup()
        server, guard = await listen(runner, "127.0.0.1", 0, cap=5)
        port = server.sockets[0].getsockname()[1]
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        async with asyncio.timeout(5):
            while len(runner.server.connections) < 5:
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once
        assert guard.refused == 1
        held[0][1].close()
        async with asyncio.timeout(5):
            while len(runner.server.connections) >= 5:
                await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as r:
            assert await r.text() == "ok"
        for _, w in held[1:]:
            w.close()
        server.close()
        await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="ringd.http_guard"):
        asyncio.run(main())
    assert "HTTP connection cap reached: 5 open" in caplog.text


def test_body_budget_books_and_refuses():
    budget = BodyBudget(limit=100)
    with budget.book(60) as a:
        assert a and budget.in_flight == 60
        with budget.book(50) as b:
            assert not b and budget.in_flight == 60
        with budget.book(40) as c:
            assert c and budget.in_flight == 100
    assert budget.in_flight == 0


def test_the_fd_limit_is_raised_toward_what_the_caps_need():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        got = raise_fd_limit(4000)
        assert got == min(4000, hard) and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    from conftest import Cluster
    from test_cluster import serving_leader

    # Two nodes: a leader that stalled would be replaced by the other, which the tests would see.
    c = Cluster(tiny_model(arch="llama", layers=4), 2, tmp_path_factory.mktemp("guard"))
    try:
        c.wait(lambda: serving_leader(c, [0, 1]) == "node0", what="node0 to serve")
        yield c
    finally:
        c.stop()


def test_four_concurrent_15_mib_prompts_are_refused_fast_and_cheaply(node):
    pid = node.procs[0].pid
    url = node.url(0) + "/v1/chat/completions"
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * (GIANT_PROMPT_BYTES // 5)}], "max_tokens": 5}).encode()
    assert GIANT_PROMPT_BYTES <= len(body) < 16 * 1024 * 1024
    term = json.loads(urllib.request.urlopen(node.url(1) + "/health", timeout=10).read())["election_term"]
    before, peak, results = rss_bytes(pid), [0], []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda: results.append(post(url, body))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    took = time.monotonic() - t0
    stop.set()
    sampler.join()
    grew = peak[0] - before
    print(f"\nfour 15 MiB prompts: refused in {took:.2f} s; leader RSS grew {grew / 2**20:.0f} MiB (from {before / 2**20:.0f} MiB)")
    assert [s for s, _ in results] == [400] * 4, results
    assert all(r["error"]["code"] == "context_length_exceeded" and r["error"]["param"] == "messages" for _, r in results)
    assert took < 10, f"took {took:.1f} s"
    assert grew < 600 * 2**20, f"RSS grew by {grew / 2**20:.0f} MiB"
    health = json.loads(urllib.request.urlopen(node.url(0) + "/health", timeout=10).read())
    assert health["role"] == "leader" and health["ready"]
    follower = json.loads(urllib.request.urlopen(node.url(1) + "/health", timeout=10).read())
    assert follower["leader"] == "node0" and follower["election_term"] == term  # no election happened


def test_2100_half_sent_requests_do_not_stop_a_normal_completion(node):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HALF_SENT + 256:
        pytest.skip(f"this test process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, HALF_SENT + 1024)), hard))
    port = node.http_ports[0]
    socks = []
    try:
        for _ in range(HALF_SENT):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            # A request line and some headers, never the blank line that ends them.
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
            socks.append(s)
        t0 = time.monotonic()
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}).encode()
        status, answer = post(node.url(0) + "/v1/chat/completions", body, timeout=30)
        took = time.monotonic() - t0
        print(f"\nwith {HALF_SENT} half-sent requests open, a completion answered in {took:.2f} s")
        assert status == 200, answer
        assert took < 10
    finally:
        for s in socks:
            s.close()
