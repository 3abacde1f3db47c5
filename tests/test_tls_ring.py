"""TLS for the API on a real ring: three `ringd serve` processes with `--tls auto`, the official openai
SDK trusting only the file `ringctl tls-ca` prints, plain HTTP refused with directions, ringctl over
https; and one node serving a certificate of the user's own (made here by a CA of the test's)."""

from __future__ import annotations

import datetime
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest
from devkit import REPO, RING_START_TIMEOUT_S
from devkit.cluster import Cluster

from ringd.security import tlsca
from ringd.base.servecmd import serve_command

MESSAGES = [{"role": "user", "content": "Tell me about rings of machines."}]


class TlsCluster(Cluster):
    """A Cluster whose nodes serve https; ``ca`` is the file clients trust."""

    ca: str | None = None

    def url(self, i: int) -> str:
        return f"https://127.0.0.1:{self.http_ports[i]}"

    def get(self, i: int, path: str) -> dict | None:
        try:
            with urllib.request.urlopen(self.url(i) + path, timeout=3, context=ssl.create_default_context(cafile=self.ca)) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None


def _ringctl(c: Cluster, *args: str, node: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ringd.app.ctl", "--node", f"127.0.0.1:{c.http_ports[node]}", "--secret-file", str(c.secret), "--cluster", c.cluster, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def tls_ring(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    c = TlsCluster(tiny_model(arch="llama", layers=6), 3, tmp, ["--tls", "auto"])
    try:
        exported = _ringctl(c, "tls-ca")
        assert exported.returncode == 0, exported.stderr
        (tmp / "ringd-ca.pem").write_text(exported.stdout)
        c.ca = str(tmp / "ringd-ca.pem")
        c.wait(lambda: all(c.leader_ready(i) for i in range(3)), RING_START_TIMEOUT_S, "the TLS ring to serve")
        yield c
    finally:
        c.stop()


def _client(c: TlsCluster, i: int, ca: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url(i) + "/v1", api_key="not-needed", max_retries=0, timeout=120, http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca)))


def test_openai_sdk_streams_through_a_follower_trusting_only_the_exported_ca(tls_ring):
    c = tls_ring
    leader = c.leader_ready(0)
    lead = int(leader.removeprefix("node"))
    follower = next(i for i in range(3) if i != lead)
    whole = _client(c, lead, c.ca).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    stream = _client(c, follower, c.ca).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
    assert text  # the tiny model says something: the comparison is not of two empty strings


def test_the_exported_ca_vouches_for_lan_names_only_and_a_node_serves_a_certificate_within_them(tls_ring):
    """The file a user may put in a system's trust store: critical name constraints (a secret's
    holder cannot pass for a public site with it), and the node's certificate within them."""
    from cryptography import x509

    ca = x509.load_pem_x509_certificate(open(tls_ring.ca, "rb").read())
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical and x509.DNSName("local") in constraints.value.permitted_subtrees
    served = x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", tls_ring.http_ports[0])).encode())
    names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert all(tlsca.permitted(str(n.value)) for n in names), names


def test_a_client_trusting_another_secrets_ca_fails_on_the_certificate(tls_ring, tmp_path):
    other = tmp_path / "other-ca.pem"
    other.write_bytes(tlsca.derive_ca(b"another secret, 32 bytes long...", tls_ring.cluster).pem)
    with pytest.raises(openai.APIConnectionError) as e:
        _client(tls_ring, 0, str(other)).models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(e.value.__cause__) or "certificate verify failed" in str(e.value.__cause__)


def test_plain_http_to_a_tls_node_gets_a_400_saying_how_to_connect(tls_ring):
    port = tls_ring.http_ports[1]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
    assert e.value.code == 400
    body = e.value.read().decode()
    assert f"this node speaks HTTPS: use https://127.0.0.1:{port}/" in body
    assert f"--cluster {tls_ring.cluster} tls-ca > ringd-ca.pem" in body


def test_the_dashboard_is_served_over_https(tls_ring):
    with httpx.Client(base_url=tls_ring.url(2), verify=ssl.create_default_context(cafile=tls_ring.ca), timeout=30) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # Its script asks for relative URLs, so it stays on the https origin it came from.
        assert client.get("/static/dashboard.js").status_code == 200


def test_ringctl_status_works_over_tls(tls_ring):
    # Given the plain address, ringctl reads the 400 and goes https, trusting the CA from the secret.
    r = _ringctl(tls_ring, "status", "--json", node=2)
    assert r.returncode == 0, r.stderr
    assert {n["node"] for n in json.loads(r.stdout)["nodes"]} == {"node0", "node1", "node2"}
    wrong = _ringctl(tls_ring, "--cluster", "another", "status", node=2)
    assert wrong.returncode == 1 and "certificate did not verify" in wrong.stderr, wrong.stderr


class OwnCertCluster(Cluster):
    """Nodes with the user's certificate; node1 trusts the user's CA (tls_ca), node2 does not."""

    ca_of: dict[int, str] = {}

    def flags(self, i: int, secret=None, name=None) -> dict:
        return {**super().flags(i, secret, name), "tls_ca": self.ca_of.get(i)}


def test_nodes_serve_the_users_own_certificate_and_a_follower_trusts_the_leader_by_tls_ca(tiny_model, tmp_path):
    # The user's CA (as mkcert's or a company's would be): not the cluster's.
    theirs = tlsca.derive_ca(b"the user's own CA key material!!", "a company CA")
    leaf = tlsca.issue(theirs, "node", ["localhost", "127.0.0.1"], datetime.datetime.now(datetime.timezone.utc))
    (tmp_path / "node.pem").write_bytes(leaf.cert_pem)
    (tmp_path / "node-key.pem").write_bytes(leaf.key_pem)
    company = tmp_path / "company-ca.pem"
    company.write_bytes(theirs.pem)
    OwnCertCluster.ca_of = {0: str(company), 1: str(company)}
    c = OwnCertCluster(tiny_model(arch="llama", layers=6), 3, tmp_path, ["--tls-cert", str(tmp_path / "node.pem"), "--tls-key", str(tmp_path / "node-key.pem")])
    try:
        def client(i: int, ca: Path) -> httpx.Client:
            return httpx.Client(base_url=f"https://127.0.0.1:{c.http_ports[i]}", verify=ssl.create_default_context(cafile=ca), timeout=60)

        def status():
            try:
                doc = client(1, company).get("/cluster/status").json()
            except httpx.TransportError:
                return None
            return doc if doc.get("ready") and doc.get("leader") == "node0" else None

        c.wait(status, RING_START_TIMEOUT_S, "the ring with the user's certificates to serve")
        request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        # node1 checks node0 with tls_ca: forwarded.
        assert client(1, company).post("/v1/chat/completions", json=request).status_code == 200
        # node2 has no tls_ca, and the user's CA is in no system store: a clear error at once, not a wait.
        refused = client(2, company).post("/v1/chat/completions", json=request)
        assert refused.status_code == 502, refused.text
        assert "its certificate is not trusted here" in refused.json()["error"]["message"] and "tls_ca" in refused.json()["error"]["message"]
        # The cluster CA did not issue the user's certificate.
        cluster_ca = tmp_path / "cluster-ca.pem"
        cluster_ca.write_bytes(tlsca.derive_ca(c.secret.read_bytes().strip(), c.cluster).pem)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            client(0, cluster_ca).get("/health")
    finally:
        c.stop()


def test_ringd_local_serves_https_on_its_handed_down_sockets_and_says_how_to_trust_it(tiny_model):
    import os
    import signal

    from devkit.procs import wait_for_line

    cmd = [sys.executable, "-m", "ringd", "local", "--nodes", "1", "--model", str(tiny_model(arch="llama", layers=6)), "--port", "0", "--tls", "auto"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        ready = wait_for_line(proc, "OpenAI API at ", RING_START_TIMEOUT_S)
        url = ready.split("OpenAI API at ", 1)[1].split()[0]
        assert url.startswith("https://127.0.0.1:")
        ca = ready.split("clients trust the cluster CA in ", 1)[1].split()[0]
        health = httpx.get(url.removesuffix("/v1") + "/health", verify=ssl.create_default_context(cafile=ca), timeout=10)
        assert health.status_code == 200 and health.json()["ready"] is True
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        proc.stdout.close()


def test_serve_with_a_key_that_is_not_the_certificates_stops_at_once_naming_both(tiny_model, tmp_path):
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = tlsca.derive_ca(b"the user's own CA key material!!", "a company CA")
    (tmp_path / "node.pem").write_bytes(tlsca.issue(ca, "node", ["localhost"], now).cert_pem)
    (tmp_path / "other-key.pem").write_bytes(tlsca.issue(ca, "node", ["localhost"], now).key_pem)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    cmd = serve_command(
        model=tiny_model(arch="llama", layers=6), secret_file=secret, http_port=0, ring_port=0, discovery=False,
        state_dir=tmp_path, tls_cert=tmp_path / "node.pem", tls_key=tmp_path / "other-key.pem",
    )  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "tls_cert and tls_key do not match" in r.stderr and "other-key.pem" in r.stderr, r.stderr[-2000:]


def test_anthropic_and_ollama_clients_connect_with_the_ca_file(tls_ring):
    import anthropic
    import ollama

    ca = ssl.create_default_context(cafile=tls_ring.ca)
    url = tls_ring.url(1)
    with anthropic.Anthropic(base_url=url, api_key="not-needed", max_retries=0, timeout=120, http_client=anthropic.DefaultHttpxClient(verify=ca)) as client:
        message = client.messages.create(model="tiny", max_tokens=4, messages=MESSAGES)
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens >= 1
    answer = ollama.Client(host=url, timeout=120, verify=ca).chat(model="tiny", messages=MESSAGES, options={"num_predict": 4})
    assert answer.done
