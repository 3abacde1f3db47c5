"""API keys and the signed control plane on real daemons, with the openai client and ringctl.

Two `ringd serve` processes (a leader and a follower that forwards) with
``--api-keys-file``: /v1 needs a key on both, /health stays open, control
routes need a request signed with the cluster secret and refuse a replay, and
a drain name no node could have is refused while the cluster keeps serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from conftest import REPO
from test_cluster import serving_leader

from ringd.auth import sign

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
    cmd = [sys.executable, "-m", "ringd.ctl", "--node", f"127.0.0.1:{c.http_ports[i]}"]
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
    from conftest import Cluster

    tmp = tmp_path_factory.mktemp("auth")
    keys = tmp / "api-keys"
    keys.write_text(f"# one key a line\n\n{KEY}\n")
    # ring_encryption on one node is enough: a link is encrypted if either end asks.
    class Encrypting(Cluster):
        def command(self, i, **kw):
            return super().command(i, **kw) + (["--ring-encryption", "on"] if i == 1 else [])

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
    logs = cluster.log_tails() + "".join(p.read_text() for p in cluster.logs.values())
    assert KEY not in logs and "wrong-key-0123456789abcdef" not in logs


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
    time.sleep(3)  # not settling: a window of six heartbeats in which nothing may go wrong
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
