"""Bounded work per request: giant prompts refused before they cost, half-sent requests and the connection cap.

The cap itself is shown in-process on a real aiohttp server with a small cap;
the rest on a real `ringd serve` (a ring of one), measured from outside: its
RSS, whether it still leads, and how fast a normal request answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import resource
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from ringd.http.guard import listen, raise_fd_limit

from test_bodies import gzip_bomb

GIANT_PROMPT_BYTES = 15 * 1024 * 1024
HALF_SENT = 2100


def post(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak_rss(pid: int) -> int:
    """Reset the process's peak resident memory (VmHWM) to what it holds now (proc(5),
    clear_refs: 5), and return that."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes(pid, "VmHWM")


def peak_rss_bytes(pid: int) -> int:
    """The most resident memory the process held since its peak was last reset (the kernel's count)."""
    return _status_bytes(pid, "VmHWM")


def loop_cpu_s(pid: int) -> float:
    """CPU seconds the process's main thread (its event loop) has run, user and system: the
    kernel's count, which does not grow while the thread waits for a core (proc(5), stat)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


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

    with caplog.at_level(logging.WARNING, logger="ringd.http.guard"):
        asyncio.run(main())
    assert "HTTP connection cap reached: 5 open" in caplog.text


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
    from devkit.cluster import Cluster
    from devkit.cluster import serving_leader

    # Three nodes: a leader that stalled would be replaced by another, which the tests would see,
    # and a follower forwards as the hostile requests were sent.
    c = Cluster(tiny_model(arch="llama", layers=4), 3, tmp_path_factory.mktemp("guard"))
    try:
        c.wait(lambda: serving_leader(c, [0, 1, 2]) == "node0", what="node0 to serve")
        yield c
    finally:
        c.stop()


def test_four_concurrent_15_mib_prompts_are_refused_cheaply_and_the_leader_keeps_leading(node):
    pid = node.procs[0].pid
    url = node.url(0) + "/v1/chat/completions"
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * (GIANT_PROMPT_BYTES // 5)}], "max_tokens": 5}).encode()
    assert GIANT_PROMPT_BYTES <= len(body) < 16 * 1024 * 1024
    term = json.loads(urllib.request.urlopen(node.url(1) + "/health", timeout=10).read())["election_term"]
    # The kernel's own peak (VmHWM), reset first, so no spike between two samples is missed.
    before = reset_peak_rss(pid)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # A generous deadline each, that raises: how long they took is a figure, printed.
        results = list(pool.map(lambda _: post(url, body, timeout=120), range(4)))
    took = time.monotonic() - t0
    grew = peak_rss_bytes(pid) - before
    print(f"\nfour 15 MiB prompts: refused in {took:.2f} s; leader RSS peaked {grew / 2**20:.0f} MiB above {before / 2**20:.0f} MiB")
    assert [s for s, _ in results] == [400] * 4, results
    assert all(r["error"]["code"] == "context_length_exceeded" and r["error"]["param"] == "messages" for _, r in results)
    assert grew < 600 * 2**20, f"RSS grew by {grew / 2**20:.0f} MiB"
    health = json.loads(urllib.request.urlopen(node.url(0) + "/health", timeout=10).read())
    assert health["role"] == "leader" and health["ready"]
    follower = json.loads(urllib.request.urlopen(node.url(1) + "/health", timeout=10).read())
    assert follower["leader"] == "node0" and follower["election_term"] == term  # no election happened


# --- one request cannot stall a node (issue 28) -----------------------------------------------

# How much of its own CPU a node's event loop may spend while a hostile request is served: far
# under the 2 s after which peers call a silent node dead (the requests held a loop 1.5 to
# 11 s). Its CPU time, not how soon /health answers: on two cores running three daemons a core
# is often busy elsewhere for longer than that, which a wall clock counts and the loop's CPU does not.
LOOP_CPU_WITHIN_S = 0.5


def ring_state(h: dict) -> tuple:
    """What every node's /health agrees on: the leader, the election's term, the plan's."""
    return h["leader"], tuple(h["election_term"]), h["term"]


def link_numbers(h: dict) -> tuple:
    """A node's links to its peers, each with its number (a new one each time it is re-made)."""
    return tuple(sorted((peer, link["number"]) for peer, link in h["links"].items()))


class HealthWatch:
    """Every node's /health, asked again and again on a thread each while a hostile request is
    served: every term and leader seen, each node's links (their numbers: a link re-made is a
    peer declared dead), the answers that failed, and the slowest answer (a figure)."""

    def __init__(self, c):
        self.c = c
        self.slowest = [0.0] * c.n
        self.seen: set[tuple] = set()
        self.links: list[set] = [set() for _ in range(c.n)]
        self.failed: list[str] = []
        self.asked = [0] * c.n
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(i,), daemon=True) for i in range(c.n)]

    def _watch(self, i: int) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.c.url(i) + "/health", timeout=30) as r:
                    h = json.loads(r.read())
            except urllib.error.HTTPError as e:  # 503: not ready (a ring lost, an election): seen too
                h = json.loads(e.read())
            except OSError as e:  # no answer within a generous deadline: the node is stuck
                self.failed.append(f"node{i}: {e!r}")
                self._stop.wait(0.02)
                continue
            self.slowest[i] = max(self.slowest[i], time.monotonic() - t0)
            self.seen.add(ring_state(h))
            self.links[i].add(link_numbers(h))
            self.asked[i] += 1
            self._stop.wait(0.02)

    def __enter__(self) -> "HealthWatch":
        for t in self._threads:
            t.start()
        # Evidence the watch runs before the request goes: every node answered once.
        deadline = time.monotonic() + 60
        while min(self.asked) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def answer_again(self, timeout: float = 60) -> None:
        """Return once every node has answered /health again: the watch has seen what came after."""
        start = list(self.asked)
        deadline = time.monotonic() + timeout
        while any(a <= s for a, s in zip(self.asked, start)):
            assert time.monotonic() < deadline, f"a node stopped answering /health: {self.asked} since {start}, {self.failed}"
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def tiny_nodes_chat(nbytes: int) -> bytes:
    """A chat request whose response_format schema is empty properties: at most ``nbytes`` of
    JSON, a value every 13 bytes or so (written as bytes: a million-key dict is seconds to dump)."""
    properties = b",".join(b'"p%d":{}' % i for i in range(nbytes // 13))
    schema = b'{"type":"object","properties":{' + properties + b"}}"
    head = b'{"model":"tiny","max_tokens":3,"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":'
    return head + schema + b"}}}"


def hostile(what: str) -> tuple[int, str, bytes, dict, int]:
    """(node, path, body, headers, expected status) of a shape issue 28 sent; built when asked
    (a gigabyte gzipped is seconds of CPU: not at collection, in every worker)."""
    chat = {"model": "tiny", "max_tokens": 3}
    json_type = {"Content-Type": "application/json"}
    if what == "a 15 MiB schema of tiny nodes, via a follower":
        return 1, "/v1/chat/completions", tiny_nodes_chat(15 * 2**20), json_type, 400
    if what == "a gzip body of 1 GiB inflated":
        return 0, "/v1/chat/completions", gzip_bomb(1024), {**json_type, "Content-Encoding": "gzip"}, 413
    if what == "4,096 user messages in a row (16 MB), Anthropic's":
        same_role = [{"role": "user", "content": "w" * 3900} for _ in range(4096)]
        return 0, "/v1/messages", json.dumps({**chat, "messages": same_role}).encode(), json_type, 400
    assert what == "15 MB of tool descriptions"
    tool = {"type": "function", "function": {"name": "f", "description": "d" * (15 * 10**6), "parameters": {"type": "object"}}}
    return 0, "/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}).encode(), json_type, 400


HOSTILE = ["a 15 MiB schema of tiny nodes, via a follower", "a gzip body of 1 GiB inflated", "4,096 user messages in a row (16 MB), Anthropic's", "15 MB of tool descriptions"]


@pytest.mark.parametrize("what", HOSTILE)
def test_no_hostile_request_stalls_any_node_or_moves_a_term(node, what):
    """Issue 28, item 1: each shape that held a loop past the 2 s dead-after, through a 3-node ring."""
    i, path, body, headers, expected = hostile(what)
    healths = [json.loads(urllib.request.urlopen(node.url(j) + "/health", timeout=30).read()) for j in range(3)]
    before = {ring_state(h) for h in healths}
    assert len(before) == 1, before
    links_before = [{link_numbers(h)} for h in healths]
    pid = node.procs[i].pid
    grew_from = reset_peak_rss(pid)
    cpu_from = [loop_cpu_s(node.procs[j].pid) for j in range(3)]
    with HealthWatch(node) as watch:
        t0 = time.monotonic()
        req = urllib.request.Request(node.url(i) + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, answer = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, answer = e.code, e.read()
        took = time.monotonic() - t0
        loop_cpu = [round(loop_cpu_s(node.procs[j].pid) - cpu_from[j], 3) for j in range(3)]
        watch.answer_again()
    grew = peak_rss_bytes(pid) - grew_from
    print(f"\n{what}: {status} in {took:.2f} s, node{i} RSS +{grew / 2**20:.0f} MiB; event loops' CPU {loop_cpu} s; slowest /health per node {[round(s, 3) for s in watch.slowest]} s")
    assert status == expected, (what, status, answer[:300])
    assert b"Traceback" not in answer
    # No loop was held: each spent little of its own CPU, answered /health throughout, and no peer
    # declared it dead (no link re-made, no election, no new plan).
    assert max(loop_cpu) < LOOP_CPU_WITHIN_S, (what, loop_cpu)
    assert not watch.failed, (what, watch.failed)
    assert watch.links == links_before, (what, watch.links, links_before)
    assert watch.seen == before, (what, watch.seen, before)
    # Cheap in memory too: what the request holds is its own bytes, a few times at most.
    assert grew < 8 * len(body) + 64 * 2**20 if expected != 413 else grew < 256 * 2**20, (what, grew)


def test_tool_descriptions_count_against_the_prompt_and_a_normal_request_is_not_kept_waiting(node):
    """Issue 28, item 2: three 8 MB tool descriptions at once held both render slots for seconds."""
    tool = {"type": "function", "function": {"name": "f", "description": "d" * (8 * 10**6), "parameters": {"type": "object"}}}
    url = node.url(0) + "/v1/chat/completions"
    big = json.dumps({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}).encode()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        giants = [pool.submit(post, url, big, 120) for _ in range(3)]
        t0 = time.monotonic()
        status, answer = post(url, CHAT, timeout=120)
        took = time.monotonic() - t0
        refused = [g.result() for g in giants]
    print(f"\nbeside three 8 MB tool descriptions, a 3-token chat answered in {took:.2f} s")
    assert status == 200, answer
    for status, error in refused:
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert "tools" in error["error"]["message"], error


def _slow_upload(port: int, declared: int) -> socket.socket:
    """A POST that declares ``declared`` bytes and sends its first: the rest would come a byte at a time."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % declared)
    return s


def _status_of(s: socket.socket) -> int:
    answer = b""
    while b"\r\n" not in answer:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    return int(answer.split()[1]) if answer else 0


def test_slow_uploads_cannot_hold_every_post_hostage(node):
    """Issue 28, item 3: 16 uploads declaring 16 MiB each and sending a byte every 2 s used the
    node's whole body budget, and every other POST got 503 until they timed out a minute later."""
    port = node.http_ports[0]
    slow = [_slow_upload(port, 16 * 2**20) for _ in range(16)]
    try:
        # Evidence the budget is taken, old rules or new: one more large upload is refused.
        deadline = time.monotonic() + 60
        while True:
            probe = _slow_upload(port, 16 * 2**20)
            probe.settimeout(1)
            try:
                refused = _status_of(probe)
            except TimeoutError:
                refused = 0
            finally:
                probe.close()
            if refused in (429, 503) or time.monotonic() > deadline:
                break
        assert refused in (429, 503), "a 17th 16 MiB upload was not refused"
        t0 = time.monotonic()
        status, answer = post(node.url(0) + "/v1/chat/completions", CHAT, timeout=120)
        print(f"\nbeside 16 slow 16 MiB uploads, a {len(CHAT)}-byte chat answered {status} in {time.monotonic() - t0:.2f} s")
        assert status == 200, answer
        # And the slow ones are dropped for their pace, not held to the minute's end (a generous
        # deadline that shows "bounded": the pace rule gives them 5 s).
        for s in slow:
            s.settimeout(45)
        statuses = [_status_of(s) for s in slow]
        assert set(statuses) <= {408, 429} and 408 in statuses, statuses
    finally:
        for s in slow:
            s.close()


def test_a_pattern_the_lexer_cannot_follow_is_a_400_before_any_token(node):
    """Issue 28, item 5: compiled, it ran the lexer out mid-answer (a 500, or a 200 then an error event)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^([a-z]{1,20}){1,50}$"}}, "required": ["a"]}
    for stream in (False, True):
        body = json.dumps({"model": "tiny", "max_tokens": 200, "stream": stream, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}).encode()
        status, answer = post(node.url(1) + "/v1/chat/completions", body)
        assert status == 400, (stream, answer)
        assert answer["error"]["param"] == "response_format.json_schema.schema" and "1000" in answer["error"]["message"], answer


def test_2100_half_sent_requests_do_not_stop_a_normal_completion(node):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = HALF_SENT + 1024  # the half-sent sockets, and room for the rest of the test process
    if hard != resource.RLIM_INFINITY and hard < need:
        hard = need  # only root (CAP_SYS_RESOURCE) may raise the hard limit
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    except (ValueError, OSError) as e:
        pytest.fail(f"this test process may open {soft} files (hard limit {resource.getrlimit(resource.RLIMIT_NOFILE)[1]}) and cannot raise that to {need}: {e}; run it as root (.ci/run does) or with `ulimit -Hn {need}`")
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
        # A generous deadline that raises; the time it took is a figure, printed.
        status, answer = post(node.url(0) + "/v1/chat/completions", body, timeout=120)
        took = time.monotonic() - t0
        print(f"\nwith {HALF_SENT} half-sent requests open, a completion answered in {took:.2f} s")
        assert status == 200, answer
    finally:
        for s in socks:
            s.close()


# --- odd bytes in headers -------------------------------------------------------------------

# A burst of malformed requests, as the issue sent (200 in 0.17 s gave 186 KB of tracebacks).
BURST = 200


def raw_request(port: int, path: str, headers: list[bytes], method: bytes = b"GET", body: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of one request written byte for byte: clients refuse to send these headers."""
    head = b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" % (method, path.encode())
    for h in headers:
        head += h + b"\r\n"
    if body:
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"\r\n" + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
# Every route family a client reaches: open, status, and /v1 (which a follower forwards).
ROUTES = [(b"GET", "/health", b""), (b"GET", "/cluster/status", b""), (b"GET", "/v1/models", b""), (b"POST", "/v1/chat/completions", CHAT)]


def log_of(c, i: int) -> str:
    return c.logs[i].read_text(errors="replace")


@pytest.mark.parametrize("i", [0, 1], ids=["leader", "follower"])
def test_a_header_that_is_not_utf8_is_a_400_naming_it_on_every_route(node, i):
    for method, path, body in ROUTES:
        for header in (b"Authorization: Bearer \xff", b"X-Request-Id: req-\xff", b"User-Agent: caf\xe9"):
            status, answer = raw_request(node.http_ports[i], path, [header], method, body)
            name = header.split(b":")[0].decode()
            assert status == 400, (path, header, status, answer)
            error = json.loads(answer)["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == name.lower(), (path, error)
            assert name.lower() in error["message"].lower() and "\udcff" not in error["message"], error
    # UTF-8 that is text stays welcome (a browser's or an SDK's user agent may be).
    assert raw_request(node.http_ports[i], "/health", ["User-Agent: café ☕".encode()])[0] == 200
    assert "Traceback" not in log_of(node, i)


def test_a_control_byte_in_any_header_is_a_400_and_one_log_line_without_the_header(node):
    secret = "sk-header-secret-0123456789abcdef"
    port = node.http_ports[0]
    odd = [
        f"Authorization: Bearer {secret}\x01", f"X-Note: {secret}\x00", f"X-Note: \x1b[31m{secret}", "X-Note: a\x7fb",
        f"X-{secret}\x01: x",  # in a header's name
        f"X-Note: {secret * 300}",  # a line over aiohttp's 8190 bytes
    ]  # fmt: skip
    for header in odd:
        for method, path, body in ROUTES:
            status, _ = raw_request(port, path, [header.encode()], method, body)
            assert status == 400, (header[:40], path, status)
    assert raw_request(port, f"/health?{secret}\x01", [])[0] == 400  # in the request line
    before = log_of(node, 0).count("\n")
    for _ in range(BURST):  # the burst
        assert raw_request(port, "/health", [f"X-Note: {secret}\x01".encode()])[0] == 400
    # The log is written before each answer goes out: what the burst logged is there now.
    text = log_of(node, 0)
    new_lines = text.count("\n") - before
    assert new_lines <= 2, f"{BURST} malformed requests logged {new_lines} lines:\n{text[-3000:]}"
    assert secret not in text and "Traceback" not in text and "Error handling request" not in text
    refusals = [line for line in text.splitlines() if "malformed HTTP request" in line]
    print("\n" + "\n".join(refusals))
    assert refusals and all("127.0.0.1" in line and "Invalid header value char" in line for line in refusals), refusals
    # The node serves on as before.
    assert raw_request(port, "/health", [])[0] == 200


def test_aiohttps_refusals_become_one_line_and_real_server_errors_pass_as_they_are():
    """MalformedRequests alone, on the records aiohttp makes (web_protocol.RequestHandler.handle_error)."""
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

    from ringd.http.guard import MalformedRequests

    guard = MalformedRequests(interval_s=3600)

    def record(exc: BaseException, level: int = logging.ERROR) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("aiohttp", level, __file__, 1, "Error handling request from %s", ("10.0.0.7",), sys.exc_info())

    quoting = BadHttpMessage("Invalid header value char:\n\n  b'Authorization: Bearer sk-live-123\\x01'\n  ^")
    first = record(quoting)
    assert guard.filter(first)
    line = first.getMessage()
    assert "sk-live" not in line and first.exc_info is None and first.levelno == logging.WARNING
    assert line == "refused 1 malformed HTTP request(s) with 400 since the last report (Invalid header value char), the latest from 10.0.0.7"
    assert not any(guard.filter(record(quoting)) for _ in range(BURST))  # counted, not logged
    assert guard.refused == BURST + 1
    long = record(LineTooLong(b"X-Note: sk-live-123" * 1000, 8190))
    guard._last_report = float("-inf")  # the interval has passed
    assert guard.filter(long) and "8190 bytes" in long.getMessage() and f"refused {BURST + 1} " in long.getMessage()
    assert "sk-live" not in long.getMessage()
    # A real server error keeps its traceback, its level and its words.
    bug = record(ZeroDivisionError("division by zero"))
    assert guard.filter(bug) and bug.exc_info is not None and bug.levelno == logging.ERROR and bug.msg == "Error handling request from %s"
