"""API keys and the signed control plane on real daemons, with the openai client and ringctl.

Two `ringd serve` processes (a leader and a follower that forwards) with
``--api-keys-file``: /v1 needs a key on both, /health stays open, control
routes need a request signed with the cluster secret and refuse a replay, and
a drain name no node could have is refused while the cluster keeps serving.
The forwarding header is a credential: without the follower's proof of the
secret it is refused, and a proven resume counts as the work it is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from devkit import REPO
from devkit.cluster import serving_leader

from ringd.security.auth import body_sha256, sign, sign_forward

KEY = "ringd-test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


def call(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ringctl(c, i: int, *args: str, secret: bool = True, env_key: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ringd.app.ctl", "--node", f"127.0.0.1:{c.http_ports[i]}"]
    # Without the secret: no flag, and a home where the default secret file is not.
    env = {k: v for k, v in os.environ.items() if k not in ("RINGD_SECRET_FILE", "RINGD_API_KEY")}
    if secret:
        cmd += ["--secret-file", str(c.secret)]
    else:
        env["HOME"] = str(c.tmp)
    if env_key:
        cmd += ["--api-key", env_key]
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=30, env=env)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    from devkit.cluster import Cluster

    tmp = tmp_path_factory.mktemp("auth")
    keys = tmp / "api-keys"
    keys.write_text(f"# one key a line\n\n{KEY}\n")
    # ring_encryption on one node is enough: a link is encrypted if either end asks.
    class Encrypting(Cluster):
        def flags(self, i, **kw):
            return {**super().flags(i, **kw), "ring_encryption": True if i == 1 else None}

    c = Encrypting(tiny_model(arch="llama", layers=4), 2, tmp, extra=["--api-keys-file", str(keys)])
    try:
        c.wait(lambda: serving_leader(c, range(2)) == "node0", what="node0 to lead")
        yield c
    finally:
        c.stop()


def client(c, i: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url(i) + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("node", [0, 1], ids=["leader", "follower"])
def test_v1_needs_a_valid_key_on_every_node(cluster, node):
    messages = [{"role": "user", "content": "hi"}]
    wrong = client(cluster, node, "wrong-key-0123456789abcdef")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert e.value.status_code == 401 and KEY not in str(e.value.response.text)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # No key at all (the openai client always sends one, so plain HTTP here).
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 3}).encode()
    status, answer = call(cluster.url(node) + "/v1/chat/completions", "POST", body)
    assert status == 401 and answer["error"]["type"] == "authentication_error" and "Bearer" in answer["error"]["message"]
    assert call(cluster.url(node) + "/v1/models")[0] == 401
    r = client(cluster, node, KEY).chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert r.choices[0].message.content is not None
    stream = client(cluster, node, KEY).chat.completions.create(model="tiny", messages=messages, max_tokens=5, stream=True)
    assert len([chunk for chunk in stream]) >= 2
    assert [m.id for m in client(cluster, node, KEY).models.list()] == ["tiny"]
    status, health = call(cluster.url(node) + "/health")  # open, but says little without a key
    assert status == 200 and set(health) == {"status", "reason", "node", "role", "leader", "ready"}, health
    assert "addr" in call(cluster.url(node) + "/health", headers={"Authorization": f"Bearer {KEY}"})[1]
    assert call(cluster.url(node) + "/cluster/status")[0] == 401
    assert call(cluster.url(node) + "/cluster/status", headers={"Authorization": f"Bearer {KEY}"})[0] == 200


def test_keys_never_reach_a_log(cluster):
    wrong = "wrong-key-0123456789abcdef"
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}).encode()
    served = []
    for i in (0, 1):  # the leader, and a follower that forwards
        for key, want in ((wrong, 401), (KEY, 200)):
            request_id = f"keys-{'right' if key == KEY else 'wrong'}-node{i}"
            status, answer = call(cluster.url(i) + "/v1/chat/completions", "POST", body, {"Authorization": f"Bearer {key}", "X-Request-Id": request_id})
            assert status == want, answer
        served.append(request_id)
    # A node logs as things happen, a line at a time, flushed: what it logged while serving a
    # request is in its log before it answers. The leader logs every request it serves under its
    # id (a follower's forward under the client's), the last line as it ends; a follower logs
    # none of them. So once the leader's log ends both right-key requests (each sent after the
    # wrong key to the same node), every line about all four is in a log.
    ended = lambda rid: re.search(rf"\[{rid}\] req=\w+: .* after \d+ tokens in", cluster.logs[0].read_text())  # noqa: E731
    cluster.wait(lambda: all(ended(rid) for rid in served), 30, f"node0's log to end requests {served}")
    logs = "".join(p.read_text() for p in cluster.logs.values())
    assert KEY not in logs and wrong not in logs


def test_ringctl_status_works_with_the_secret_or_a_key_and_not_without(cluster):
    assert "node1" in ringctl(cluster, 1, "status").stdout
    assert "node1" in ringctl(cluster, 1, "status", secret=False, env_key=KEY).stdout
    r = ringctl(cluster, 1, "status", secret=False)
    assert r.returncode == 1 and "401" in r.stderr


def test_control_routes_need_the_cluster_secret_and_refuse_replays(cluster):
    before = call(cluster.url(0) + "/health", headers=AUTH)[1]
    for i in (0, 1):
        for path, body in (("/cluster/drain", {"node": "node1"}), ("/cluster/leader", {"node": "node1"})):
            status, answer = call(cluster.url(i) + path, "POST", json.dumps(body).encode())
            assert status == 401 and "signed with the cluster secret" in answer["error"]["message"], (path, answer)
            forged = sign(b"not-the-secret-0123456789", "POST", path, f"node{i}", json.dumps(body).encode(), time.time())
            status, answer = call(cluster.url(i) + path, "POST", json.dumps(body).encode(), forged)
            assert status == 403, answer
    after = call(cluster.url(0) + "/health", headers=AUTH)[1]
    assert after["pin"] == before["pin"] and after["drained"] == [] and after["leader"] == "node0"

    # Signed with the secret it works (ringctl), once: the same request again is a replay.
    secret = cluster.secret.read_bytes().strip()
    body = json.dumps({"node": None}).encode()
    headers = sign(secret, "POST", "/cluster/leader", "node1", body, time.time())
    assert call(cluster.url(1) + "/cluster/leader", "POST", body, headers)[0] == 200
    status, answer = call(cluster.url(1) + "/cluster/leader", "POST", body, headers)
    assert status == 401 and "replay" in answer["error"]["message"]
    # Signed for node1, sent to node0: refused there too.
    status, answer = call(cluster.url(0) + "/cluster/leader", "POST", body, sign(secret, "POST", "/cluster/leader", "node1", body, time.time()))
    assert status == 403 and "signed for node 'node1'" in answer["error"]["message"]
    # A node that is not a name answers 400 (a list once answered 500).
    for bad in ([["node1"]], {"x": 1}, 7):
        body = json.dumps({"node": bad}).encode()
        status, answer = call(cluster.url(0) + "/cluster/leader", "POST", body, sign(secret, "POST", "/cluster/leader", "node0", body, time.time()))
        assert status == 400 and answer["error"]["param"] == "node", answer
    assert "drained: node1" in ringctl(cluster, 1, "drain", "node1").stdout  # through the follower
    assert "drained: none" in ringctl(cluster, 0, "drain", "node1", "--undo").stdout


def test_a_70000_character_drain_name_is_refused_and_the_cluster_keeps_serving(cluster):
    name = "x" * 70_000
    status, answer = call(cluster.url(0) + "/cluster/drain", "POST", json.dumps({"node": name}).encode())
    assert status == 401
    r = ringctl(cluster, 0, "drain", name)
    assert r.returncode == 1 and "400" in r.stderr and "not a node name" in r.stderr
    for bad in ("a b", "", "-x", "node/1"):
        r = ringctl(cluster, 1, "drain", bad)
        assert r.returncode != 0, bad
    term = call(cluster.url(0) + "/health", headers=AUTH)[1]["election_term"]
    # Not settling: a window of six heartbeat rounds on each node in which nothing may go wrong.
    beats = {i: metric(cluster, i, "ringd_heartbeats_total") for i in (0, 1)}
    cluster.wait(lambda: all(metric(cluster, i, "ringd_heartbeats_total") >= beats[i] + 6 for i in (0, 1)), 60, "six heartbeat rounds on each node")
    health = call(cluster.url(0) + "/health", headers=AUTH)[1]
    assert health["drained"] == [] and health["task_restarts"] == {} and health["election_term"] == term
    assert call(cluster.url(1) + "/health")[0] == 200
    r = client(cluster, 1, KEY).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def test_the_ring_links_are_encrypted_when_one_end_asks(cluster):
    for i, peer in ((0, "node1"), (1, "node0")):
        health = call(cluster.url(i) + "/health", headers=AUTH)[1]
        assert health["links"][peer]["encrypted"] is True, health["links"]
    assert call(cluster.url(1) + "/health", headers=AUTH)[1]["ring_encryption"] is True


def test_a_control_request_signed_too_far_ahead_is_refused_with_the_offset(cluster):
    secret = cluster.secret.read_bytes().strip()
    body = json.dumps({"node": None}).encode()
    ahead = sign(secret, "POST", "/cluster/leader", "node0", body, time.time() + 75)
    status, answer = call(cluster.url(0) + "/cluster/leader", "POST", body, ahead)
    message = answer["error"]["message"]
    assert status == 401 and re.search(r"timestamp is 7[5-9] s ahead of this node's clock; the window is 60 s: check the clocks \(NTP\)", message), answer


def metric(c, i: int, name: str) -> float:
    """A counter of node i's /metrics (0 if it has not been touched)."""
    with urllib.request.urlopen(c.url(i) + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf'^{name}{{node="node{i}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


WORK = ("ringd_prompt_tokens_total", "ringd_completion_tokens_total", "ringd_resumed_tokens_total", "ringd_replays_total")


def chat_body(resume: dict | None = None, stream: bool = True, max_tokens: int = 5) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if resume is not None:
        body["ringd_resume"] = resume
    return json.dumps(body).encode()


def test_a_clients_forwarded_by_header_without_the_followers_proof_is_refused_and_its_resume_costs_nothing(cluster):
    """The issue's request: 4,000 ids to replay, with the response's id and time of the client's
    choosing. Without the follower's proof it is refused before the ring does anything."""
    secret = cluster.secret.read_bytes().strip()
    body = chat_body({"tokens": [7] * 4000, "id": "chatcmpl-mine", "created": 1})
    before = [metric(cluster, 0, m) for m in WORK]
    for i in (0, 1):  # the leader, and a follower, which would forward it
        url = cluster.url(i) + "/v1/chat/completions"
        status, answer = call(url, "POST", body, {**AUTH, "X-Ringd-Forwarded-By": "node1"})
        assert status == 401 and answer["error"]["code"] == "forwarding_not_proven", answer
        assert "a client must not send it" in answer["error"]["message"] and answer["error"]["type"] == "authentication_error"
        # With a proof made with another secret, or for this body by the follower but sent with another: 403.
        forged = sign_forward(b"not-the-secret-0123456789", "POST", "/v1/chat/completions", "node1", f"node{i}", body_sha256(body), time.time())
        status, answer = call(url, "POST", body, {**AUTH, **forged})
        assert status == 403 and answer["error"]["code"] == "forwarding_not_proven", answer
        other = sign_forward(secret, "POST", "/v1/chat/completions", "node1", f"node{i}", body_sha256(chat_body()), time.time())
        assert call(url, "POST", body, {**AUTH, **other})[0] == 403
    assert [metric(cluster, 0, m) for m in WORK] == before  # no prompt, no replay: no work at all


def test_a_proven_forward_resumes_and_its_resumed_tokens_count_as_work(cluster):
    secret = cluster.secret.read_bytes().strip()
    resumed = [7] * 40
    body = chat_body({"tokens": resumed, "id": "chatcmpl-carried", "created": 1234}, max_tokens=45)
    before = {m: metric(cluster, 0, m) for m in WORK}
    headers = {**AUTH, **sign_forward(secret, "POST", "/v1/chat/completions", "node1", "node0", body_sha256(body), time.time())}
    req = urllib.request.Request(cluster.url(0) + "/v1/chat/completions", data=body, method="POST", headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    new = sum(line.startswith(": ringd-token ") for line in lines)  # one per token made here, for the follower
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "data: [DONE]" in lines, lines[-5:]
    # Greedy, the tiny model never says EOS here: it runs to max_tokens, the ids resumed counted in.
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert new == 45 - len(resumed) and finishes == ["length"], lines[-8:]
    assert all(c["id"] == "chatcmpl-carried" and c["created"] == 1234 for c in chunks)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(resumed) + new and usage["total_tokens"] == usage["prompt_tokens"] + len(resumed) + new, usage
    after = {m: metric(cluster, 0, m) for m in WORK}
    assert after["ringd_resumed_tokens_total"] - before["ringd_resumed_tokens_total"] == len(resumed)
    assert after["ringd_completion_tokens_total"] - before["ringd_completion_tokens_total"] == new
    assert after["ringd_prompt_tokens_total"] - before["ringd_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["ringd_replays_total"] - before["ringd_replays_total"] == 1
    # The same proof again is a replay; a resume on a request that does not stream is not a follower's.
    assert call(cluster.url(0) + "/v1/chat/completions", "POST", body, headers)[0] == 401
    whole = chat_body({"tokens": resumed, "id": None, "created": None}, stream=False, max_tokens=45)
    proof = sign_forward(secret, "POST", "/v1/chat/completions", "node1", "node0", body_sha256(whole), time.time())
    status, answer = call(cluster.url(0) + "/v1/chat/completions", "POST", whole, {**AUTH, **proof})
    assert status == 400 and answer["error"]["param"] == "ringd_resume", answer


def test_the_bearer_scheme_is_case_insensitive(cluster):
    """RFC 7235 section 2.1: ``bearer KEY`` and ``BEARER KEY`` are ``Bearer KEY``."""
    for scheme in ("bearer", "BEARER", "BeArEr"):
        headers = {"Authorization": f"{scheme} {KEY}"}
        for i in (0, 1):
            assert call(cluster.url(i) + "/v1/models", headers=headers)[0] == 200, (scheme, i)
            assert "addr" in call(cluster.url(i) + "/health", headers=headers)[1]
    for wrong in ("Basic " + KEY, KEY, "Bearer", "Bearer "):
        status, answer = call(cluster.url(0) + "/v1/models", headers={"Authorization": wrong})
        assert status == 401 and "Bearer KEY" in answer["error"]["message"], (wrong, answer)


def test_odd_bytes_around_a_key_are_4xx_and_the_key_reaches_no_log(cluster):
    from test_guard import BURST, ROUTES, raw_request

    for i in (0, 1):
        port = cluster.http_ports[i]
        for method, path, body in ROUTES:
            # Not UTF-8: the routes refuse it, naming the header, never echoing it.
            for value in (b"Bearer \xff", f"Bearer {KEY}\xff".encode("latin-1"), f"bearer {KEY[:-1]}\xe9".encode("latin-1")):
                status, answer = raw_request(port, path, [b"Authorization: " + value], method, body)
                error = json.loads(answer)["error"]
                assert status == 400 and error["param"] == "authorization" and KEY not in answer.decode(), (path, value, answer)
            # A control byte: aiohttp's parser refuses it before any route (and its answer
            # quotes the line to the client that sent it; its log line does not).
            for header in (f"Authorization: Bearer {KEY}\x01", f"Authorization: Bearer\x00{KEY}", f"X-Note: {KEY}\x1b"):
                assert raw_request(port, path, [header.encode()], method, body)[0] == 400, (path, header)
        before = cluster.logs[i].read_text().count("\n")
        for _ in range(BURST):
            assert raw_request(port, "/health", [f"Authorization: Bearer {KEY}\x7f".encode()])[0] == 400
        text = cluster.logs[i].read_text(errors="replace")
        assert text.count("\n") - before <= 2, text[-3000:]
        assert KEY not in text and "Traceback" not in text, text[-3000:]
    # With the key right, both nodes still serve.
    assert call(cluster.url(1) + "/v1/models", headers=AUTH)[0] == 200


@pytest.mark.parametrize("node", [0, 1], ids=["leader", "follower"])
def test_anthropics_sdk_sends_its_key_as_x_api_key(cluster, node):
    import anthropic

    def messages(key: str):
        c = anthropic.Anthropic(base_url=cluster.url(node), api_key=key, max_retries=0, timeout=60)
        return c.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])

    with pytest.raises(anthropic.AuthenticationError) as e:
        messages("wrong-key-0123456789abcdef")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert messages(KEY).type == "message"
    # Ollama's clients send no key header of their own: a Bearer key (OLLAMA_API_KEY's form) is needed; refusals in Ollama's shape.
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}).encode()
    status, answer = call(cluster.url(node) + "/api/chat", "POST", body)
    assert status == 401 and isinstance(answer["error"], str)
    assert call(cluster.url(node) + "/api/chat", "POST", body, AUTH)[0] == 200
