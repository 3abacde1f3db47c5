"""A stream outlives its leader (proxy.py): a follower carries it over, or ends it cleanly.

Real `ringd serve` processes, kill -9 of the leader while a client streams
through a follower, the real openai client reading the stream; and clients
that hang up the moment they have ``data: [DONE]``, the normal end of a stream.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from devkit.cluster import Cluster
from devkit.clients import Stream, stream_text
from devkit.cluster import serving_leader

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me everything about rings."}]
TOKENS = 300


def test_kill_9_of_the_leader_mid_stream_through_a_follower_loses_nothing(tiny_model, tmp_path):
    c = Cluster(tiny_model(arch="llama", layers=6), 3, tmp_path)
    try:
        c.wait(lambda: serving_leader(c, range(3)) == "node0", what="node0 to lead")
        whole, finish = stream_text(c.url(2) + "/v1", MESSAGES, TOKENS)
        assert finish == "length"
        killed = []

        def kill_at(i):
            if i == 40 and not killed:
                c.signal(0, signal.SIGKILL)
                killed.append(time.monotonic())

        again, finish = stream_text(c.url(2) + "/v1", MESSAGES, TOKENS, kill_at)
        assert killed and finish == "length"
        assert again == whole, "the stream carried over to the new leader differs from the uninterrupted run"
        assert c.wait(lambda: serving_leader(c, [1, 2]), what="the survivors to agree") == "node1"
        assert "carrying it over to the next leader" in c.logs[2].read_text()
        # The new leader replayed the ids the client already had: counted as the work they are.
        carried = int(re.findall(r"broke after (\d+) token\(s\)", c.logs[2].read_text())[-1])
        with urllib.request.urlopen(c.url(1) + "/metrics", timeout=30) as r:
            resumed = re.search(r'^ringd_resumed_tokens_total\{node="node1"\} (\S+)$', r.read().decode(), re.M)
        assert carried > 0 and resumed and float(resumed.group(1)) >= carried, (carried, resumed)
    finally:
        c.stop()


def test_with_no_leader_to_carry_it_over_a_stream_ends_with_an_error_event_and_done(tiny_model, tmp_path):
    from ringd.models.source import model_info

    model = tiny_model(arch="llama", layers=8, hidden_size=128, dtype="float32")
    # Each node can hold a little more than half the model: when node0 dies,
    # node1 alone cannot serve, and no leader will within failover_wait_s.
    budget_gb = model_info(str(model)).weights.stage(0, 8) * 0.6 / 2**30
    extra = ["--memory-budget-gb", f"{budget_gb:.9f}", "--kv-reserve-tokens", "1", "--failover-wait-s", "3"]
    c = Cluster(model, 2, tmp_path, extra=extra)
    try:
        c.wait(lambda: serving_leader(c, range(2)) == "node0", what="node0 to lead")
        s = Stream(c.url(1), MESSAGES, 200)  # a context the small budgets leave KV room for
        s.wait_started(5)
        c.signal(0, signal.SIGKILL)
        assert s.join(60), s
        assert s.status == 200 and s.clean and s.error is not None, s  # an OpenAI error event, then data: [DONE]
        assert s.error["type"] == "service_unavailable" and "no new one served within 3 s" in s.error["message"], (s.error, c.log_tails())
        assert s.finish is None and s.chunks >= 5
    finally:
        c.stop()


def _stream_and_close_at_done(url: str, max_tokens: int) -> bytes:
    """A streamed chat on a raw socket, closed the moment ``data: [DONE]`` arrives, as curl or a
    script that stops reading there does; what arrived, for the assertion's message."""
    u = urlsplit(url)
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    seen = b""
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(head.encode() + body)
        while b"data: [DONE]" not in seen:
            data = s.recv(65536)
            if not data:
                break
            seen += data
    return seen


# Streams whose clients close at data: [DONE] (once, 13 in 300 of them left an error).
STREAMS = 300


def chat_requests_answered(c, i: int) -> float:
    """Node i's ringd_requests_total for /v1/chat/completions, every status summed."""
    with urllib.request.urlopen(c.url(i) + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for labels, value in re.findall(r"^ringd_requests_total\{(.*)\} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("endpoint") == "/v1/chat/completions":
            total += float(value)
    return total


def test_a_client_that_closes_right_after_done_on_a_follower_logs_no_error(tiny_model, tmp_path):
    c = Cluster(tiny_model(arch="llama", layers=2), 2, tmp_path)
    try:
        c.wait(lambda: serving_leader(c, range(2)) == "node0", what="node0 to lead")
        # Once, 13 in 300 such streams left "Cannot write to closing transport" at ERROR on the follower.
        before = {i: chat_requests_answered(c, i) for i in (0, 1)}
        with ThreadPoolExecutor(4) as pool:
            seen = list(pool.map(lambda _: _stream_and_close_at_done(c.url(1), 3), range(STREAMS)))
        assert all(b"data: [DONE]" in s for s in seen), [s for s in seen if b"data: [DONE]" not in s][:1]
        # A request is counted as its handler ends, whatever it ended with: once both nodes have
        # counted all of them, all they logged of them is in their logs (written as it happens).
        c.wait(
            lambda: all(chat_requests_answered(c, i) >= before[i] + STREAMS for i in (0, 1)), 60,
            f"both nodes to finish the {STREAMS} requests",
        )  # fmt: skip
        for i in (1, 0):  # the follower the clients left, and the leader its upstream left
            errors = [line for line in c.logs[i].read_text().splitlines() if f" node{i} E " in line]
            assert not errors, "\n".join(errors[:20])
        assert "carrying it over" not in c.logs[1].read_text()  # a client that left is no lost leader
    finally:
        c.stop()


def test_a_token_with_no_chunk_of_its_own_still_reaches_the_follower_as_an_id():
    """A token that adds nothing to the answer (a call's held piece, text held for a stop string)
    sends no chunk; the leader still sends its id, as a comment-only event (endpoint.py), so a
    stream carried over to another leader resumes after it. The follower's side, in process: the
    bytes as the leader writes them, split into events as ``_Stream`` reads them."""
    import asyncio

    from ringd.http.proxy import TOKEN_COMMENT, _Stream

    class Client:  # what _Stream writes to: the client's response (aiohttp's, in the daemon)
        def __init__(self):
            self.data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    chunk = b'data: {"id": "c1", "created": 1, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
    wire = TOKEN_COMMENT + b"5\n" + chunk + TOKEN_COMMENT + b"6\n\n" + TOKEN_COMMENT + b"7\n" + chunk
    stream = _Stream(None, None, b"")
    stream.resp = Client()

    async def relay():
        for event in wire.split(b"\n\n")[:-1]:
            await stream._relay(event)

    asyncio.run(relay())
    assert stream.tokens == [5, 6, 7] and stream.resp.data == chunk + chunk and stream.id == "c1"
