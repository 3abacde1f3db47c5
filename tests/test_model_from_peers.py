"""Weights between peers through real daemons: one node holds the model, two start with nothing.

Three `ringd serve` processes on loopback; node0 has the model (a Q4_1 GGUF file as
llama.cpp writes one, the real SmolLM2's type, or the mlx-lm directory ``ringd convert``
makes of it), node1 and node2 have
``model_from_peers`` and an empty ``models_dir``. They fetch their layers from node0,
and the ring answers as single-process mlx-lm does; each fetcher's directory holds
its stage's tensors, config and tokenizer, not the model. A drain gives node1 the
layers node2 had: it fetches them, and the answers stay the same. The ring of the mlx-lm
directory has ``ring_encryption`` on: its links are encrypted, and so are the weights its
fetchers ask for (sealed: models/peers/sealing.py). The model is a tiny
random llama (the answers are compared token for token, not read): the real SmolLM2
costs ~0.3 s of CPU a token here, and its fetch is ``ringd demo``'s (tests/test_demo.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from devkit import REPO, RING_START_TIMEOUT_S
from devkit.cluster import Cluster
from devkit.clients import post

from ringd.models.peers import PeerModel
from ringd.base.servecmd import serve_command

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 24
LAYERS = 12


class PeerCluster(Cluster):
    """node0 holds ``model``; the others fetch theirs into models/nodeI."""

    def flags(self, i: int, secret: Path | None = None, name: str | None = None) -> dict:
        flags = super().flags(i, secret, name)
        if i == 0:
            return flags
        return {**flags, "model": None, "model_from_peers": True, "models_dir": self.models_dir(i)}

    def models_dir(self, i: int) -> Path:
        return self.tmp / "models" / f"node{i}"


def disk_bytes(root: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file())


def answer(c: Cluster) -> str:
    status, body = post(c.url(0) + "/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": TOKENS, "temperature": 0}, timeout=120)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def q4_1(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """A 12-layer llama as a Q4_1 GGUF (tests/kit/ggufmake.py), and what `ringd convert` makes of it."""
    from devkit.ggufmake import write_gguf

    # Rows of 320 and 640: whole Q4_1 blocks but no K-quant super-blocks (llama-quantize would
    # write the head as Q6_K), and tensors far above a disk block, so that what a fetcher holds
    # on disk measures what it fetched.
    source = tiny_model(arch="llama", layers=LAYERS, hidden_size=320, intermediate_size=640, dtype="float32")
    out = tmp_path_factory.mktemp("q4_1")
    gguf_file = write_gguf(source, out / "tiny-llama.Q4_1.gguf", qtype="q4_1")
    r = subprocess.run([sys.executable, "-m", "ringd", "convert", str(gguf_file), str(out / "converted")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return gguf_file, out / "converted"


def expected(converted: Path) -> str:
    """mlx-lm's greedy answer, from the directory `ringd convert` wrote of the file."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(converted))
    text = generate(model, tokenizer, tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True), max_tokens=TOKENS)
    assert len(tokenizer.encode(text)) >= TOKENS // 2, f"too short an answer to compare: {text!r}"
    return text


def layers_of(c: Cluster) -> dict[str, tuple[int, int]]:
    doc = c.status(0) or {}
    return {n["node"]: tuple(n["layers"]) for n in doc.get("nodes", []) if n.get("layers")}


def check_shares(c: Cluster, layers: dict[str, tuple[int, int]]) -> None:
    """Each fetcher holds its stage's tensors, the headers, config and tokenizer: within 20%, not the model."""
    for i in (1, 2):
        (root,) = [d for d in c.models_dir(i).iterdir() if d.is_dir()]
        fetched = PeerModel.open(root, b"", f"node{i}")
        share = sum(b - a for spans in fetched.stage_ranges(*layers[f"node{i}"], LAYERS).values() for a, b in spans)
        meta = sum(f.head for f in fetched.manifest.files)
        held = disk_bytes(root)
        assert held <= 1.2 * (share + meta), (f"node{i}", held, share, meta)
        assert held < 0.75 * fetched.manifest.total_bytes


def serving(c: Cluster) -> bool:
    return all((c.get(i, "/health") or {}).get("ready") for i in range(3))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["gguf", "mlx-lm directory"])
def test_two_nodes_with_nothing_fetch_their_layers_and_the_ring_answers_as_mlx_lm(form, q4_1, tmp_path):
    gguf_file, converted = q4_1
    model = gguf_file if form == "gguf" else converted
    c = PeerCluster(model, 3, tmp_path, extra=["--ring-encryption", "on"] if form != "gguf" else [])
    try:
        c.wait(lambda: serving(c), 2 * RING_START_TIMEOUT_S, "the ring to serve, its layers fetched")
        layers = layers_of(c)
        assert layers == {"node0": (0, 4), "node1": (4, 8), "node2": (8, 12)}, layers
        want = expected(converted)
        assert answer(c) == want
        check_shares(c, layers)
        if form != "gguf":  # sealed both ways: a holder with ring_encryption sends nothing in the clear
            links = (c.get(0, "/health") or {}).get("links", {})
            assert all(links[p]["encrypted"] for p in ("node1", "node2")), links
            return
        # A drain gives node1 layers it has not got: it fetches them, and the ring answers the same.
        r = subprocess.run(
            [sys.executable, "-m", "ringd.app.ctl", "--node", f"127.0.0.1:{c.http_ports[0]}", "--secret-file", str(c.secret), "drain", "node2"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        c.wait(lambda: set(layers_of(c)) == {"node0", "node1"} and (c.status(0) or {}).get("ready"), 2 * RING_START_TIMEOUT_S, "the ring without node2")
        moved = layers_of(c)["node1"]
        assert moved[1] == LAYERS and moved[0] < 8, moved
        assert answer(c) == want
        fetches = [line for line in c.logs[1].read_text().splitlines() if "from peers in" in line]
        assert len(fetches) == 3, fetches  # the headers, layers [4, 8), then the layers it lacked
    finally:
        c.stop()


def test_with_no_peer_holding_the_model_the_hub_as_before(tiny_model, tmp_path):
    """model_from_peers with a repo id and nobody to fetch from: the Hub (a local fake of it) serves."""
    from devkit.fakehub import FakeHub

    from devkit.ports import port

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    http = port()
    with FakeHub({"ringd-test/tiny": tiny_model(arch="llama", layers=4, dtype="float32")}) as hub:
        cmd = serve_command(
            name="node0", cluster=f"hub-{os.getpid()}", host="127.0.0.1", advertise="127.0.0.1", http_host="127.0.0.1",
            ring_port=port(), http_port=http, model="ringd-test/tiny", model_from_peers=True, models_dir=tmp_path / "models",
            secret_file=secret, state_dir=tmp_path / "state", discovery=False, nodes=1,
            peer=[f"127.0.0.1:{port()}"],  # nobody there
        )  # fmt: skip
        log = tmp_path / "node0.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **hub.env(tmp_path / "hf")}, stdout=out, stderr=out, start_new_session=True)
        try:
            status, body = 0, {}
            deadline = time.monotonic() + RING_START_TIMEOUT_S
            while status != 200:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                status, body = post(f"http://127.0.0.1:{http}/v1/completions", {"model": "ringd-test/tiny", "prompt": "hi", "max_tokens": 4}, timeout=10)
                time.sleep(0.2)
            assert "no peer holds a model; fetching ringd-test/tiny as configured" in log.read_text()
            assert any(f.endswith(".safetensors") for f in hub.fetched())  # from the Hub
            assert not any((tmp_path / "models").glob("*/*"))  # nothing from peers
        finally:
            proc.terminate()
            proc.wait(30)


def test_a_node_waiting_for_a_holder_says_so_and_stops_on_a_signal(tmp_path):
    import signal

    from devkit.ports import port

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    cmd = serve_command(
        name="lonely", cluster=f"alone-{os.getpid()}", host="127.0.0.1", advertise="127.0.0.1", http_host="127.0.0.1",
        ring_port=port(), http_port=port(), model_from_peers=True, models_dir=tmp_path / "models", secret_file=secret,
        state_dir=tmp_path / "state", discovery=False, peer=[f"127.0.0.1:{port()}"],
    )  # fmt: skip
    log = tmp_path / "lonely.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + RING_START_TIMEOUT_S
        while "no peer holding a model found yet" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


class OnDemandCluster(Cluster):
    """node0 leads and has a model list (models/node0); node1 has an empty one, model_from_peers,
    and the more memory: a model loaded on demand is placed on node1 alone."""

    def flags(self, i: int, secret: Path | None = None, name: str | None = None) -> dict:
        flags = super().flags(i, secret, name)
        if i == 0:
            return {**flags, "models_dir": self.tmp / "models" / "node0", "memory_budget_gb": 1}
        return {**flags, "model_from_peers": True, "models_dir": self.tmp / "models" / "node1", "memory_budget_gb": 4}


def test_a_node_without_a_model_s_files_fetches_its_layers_of_a_model_loaded_on_demand_from_the_leader(tiny_model, tmp_path):
    """A request names a model only the leader's list holds; the placement puts its layers on
    node1, whose list lacks it: node1 fetches them from the leader (model_from_peers), checked,
    and the answer is mlx-lm's; node1's list does not show the fetched copy as a model of its own."""
    from devkit.reference import reference

    a, b = tiny_model(arch="llama", layers=2), tiny_model(arch="qwen3", layers=4)
    (tmp_path / "models" / "node1").mkdir(parents=True)
    (tmp_path / "models" / "node0").mkdir(parents=True)
    (tmp_path / "models" / "node0" / "tiny-b").symlink_to(b, target_is_directory=True)
    c = OnDemandCluster(a, 2, tmp_path)
    try:
        c.wait(lambda: c.leader_ready(0) == "node0", RING_START_TIMEOUT_S, "node0 to lead a ring that serves")
        prompt = [4, 8, 15, 16, 23, 42]
        status, body = post(c.url(0) + "/v1/completions", {"model": "tiny-b", "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 1,
                                                            "return_tokens_as_token_ids": True}, timeout=180)  # fmt: skip
        assert status == 200, (body, c.log_tails())
        got = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
        assert got == reference(b, prompt, 10)[0]
        rows = {r["ringd"]["instance"]: r["ringd"] for r in c.get(0, "/api/ps")["models"]}
        assert [s[0] for s in rows["tiny-b"]["stages"]] == ["node1"], rows
        (fetched,) = [d for d in (tmp_path / "models" / "node1").iterdir() if d.is_dir()]
        assert PeerModel.open(fetched, b"", "node1") is not None  # checked against the leader's manifest
        listed = c.get(1, "/cluster/models")["models"]
        assert not any(str(fetched) in r["path"] for r in listed), listed
    finally:
        c.stop()
