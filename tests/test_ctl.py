"""`ringctl top` in a real terminal (tmux) against real daemons, what it draws from a status document,
and for which node ringctl signs.

The live test runs top in a tmux pane 160 columns wide, reads the pane with
``tmux capture-pane``, and changes the cluster under it: a drain, an undrain, the
node top asks going away and coming back. tmux runs on a socket of the test's
own, so it never touches a user's sessions.

A node's name comes from its open /health, which anything at an address can
answer: the signing tests put an HTTP server there that says it is whichever
node it is told to (what a device on the LAN can do) and record what reaches it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from devkit import REPO
from devkit.cluster import serving_leader

from ringd.app.ctl.render import print_status
from ringd.app.ctl.top import top_view

# Generous: a pane redraws every 0.5 s, but a node's restart loads its model and replans.
PANE_TIMEOUT_S = 90.0


class Pane:
    """One tmux pane running a command, on a private tmux server; the pane stays after the command exits.

    The command's exit status goes to a file: tmux's own #{pane_dead_status} is
    sometimes left empty when a command exits on Ctrl-C.
    """

    def __init__(self, tmp, command: list[str]):
        self.socket = tmp / "tmux.sock"
        self.status_file = tmp / "exit-status"
        conf = tmp / "tmux.conf"
        conf.write_text("set -g remain-on-exit on\n")  # keep the pane (and what it shows) if the command dies early
        # The pane's own size governs, as a terminal's does: not COLUMNS and LINES (pytest-xdist's
        # workers set 80 x 24, and rich would draw that narrow in a 160-column pane).
        env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "COLUMNS", "LINES")}
        # The trap keeps the shell alive through Ctrl-C (the command still gets it: a trapped
        # signal is the default again in a child) so that it can write the exit status.
        shell = f"trap : INT; {shlex.join(command)}; echo $? > {shlex.quote(str(self.status_file))}"
        self.tmux("-f", str(conf), "new-session", "-d", "-s", "top", "-x", "160", "-y", "40", shell, env=env)

    def tmux(self, *args: str, env: dict | None = None) -> str:
        r = subprocess.run(["tmux", "-S", str(self.socket), *args], capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 0, f"tmux {' '.join(args)}: {r.stderr}"
        return r.stdout

    def text(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def wait(self, predicate, what: str, logs=lambda: "") -> str:
        deadline = time.monotonic() + PANE_TIMEOUT_S
        while True:
            text = self.text()
            if predicate(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {PANE_TIMEOUT_S} s waiting for {what}; the pane shows:\n{text}\n{logs()}")
            time.sleep(0.1)

    def exit_status(self) -> int | None:
        """The command's exit status once it has exited (and the shell has written it), else None."""
        text = self.status_file.read_text() if self.status_file.exists() else ""
        return int(text) if text.endswith("\n") else None

    def close(self) -> None:
        subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], capture_output=True, timeout=30)


def row(text: str, node: str) -> str:
    """The table row of ``node`` in the pane ('' if none)."""
    return next((line for line in text.splitlines() if re.search(rf"│ {node}\s+│", line)), "")


def test_top_redraws_what_changes_keeps_trying_and_quits_on_ctrl_c(tiny_model, cluster_factory, tmp_path):
    assert shutil.which("tmux"), "tmux is not installed: top needs a real terminal; `apt-get install tmux` (.ci/run installs it)"
    c = cluster_factory(tiny_model(arch="llama", layers=2), 2)
    c.wait(lambda: serving_leader(c, range(2)) == "node0", what="node0 to lead a ring of two")

    def ctl(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ringd.app.ctl", "--node", f"127.0.0.1:{c.http_ports[0]}", "--secret-file", str(c.secret), *args]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)

    top = [sys.executable, "-m", "ringd.app.ctl", "--node", f"127.0.0.1:{c.http_ports[0]}", "--secret-file", str(c.secret), "top", "--interval", "0.5"]
    pane = Pane(tmp_path, top)
    try:
        text = pane.wait(lambda t: "ready" in row(t, "node0") and "ready" in row(t, "node1"), "both nodes in the table", c.log_tails)
        assert "leader node0 · ready · term" in text and "[0, 1)" in row(text, "node0") and "[1, 2)" in row(text, "node1")

        assert ctl("drain", "node1").returncode == 0
        text = pane.wait(lambda t: "drained" in row(t, "node1") and "[0, 2)" in row(t, "node0"), "node1 drained, node0 all layers", c.log_tails)
        assert " - " in row(text, "node1")  # no stage, no layers
        assert ctl("drain", "node1", "--undo").returncode == 0
        pane.wait(lambda t: "[1, 2)" in row(t, "node1") and "ready" in row(t, "node1"), "node1 back in the ring", c.log_tails)

        # The node top asks goes away: the header says so, the last table stays, top keeps asking.
        c.signal(0, signal.SIGTERM)
        text = pane.wait(lambda t: "retrying every 0.5 s" in t, "the error in the header", c.log_tails)
        assert "cannot read http://127.0.0.1" in text and "node1" in row(text, "node1")
        c.start(0)
        pane.wait(lambda t: "retrying" not in t and "ready" in row(t, "node0") and "leader" in t, "top to see node0 again", c.log_tails)

        assert pane.exit_status() is None
        pane.tmux("send-keys", "-t", "top", "C-c")
        deadline = time.monotonic() + PANE_TIMEOUT_S
        while pane.exit_status() is None:
            assert time.monotonic() < deadline, f"top still runs {PANE_TIMEOUT_S} s after Ctrl-C:\n{pane.text()}"
            time.sleep(0.1)
        assert pane.exit_status() == 0, pane.text()
    finally:
        pane.close()


def test_top_refuses_a_pipe():
    r = subprocess.run([sys.executable, "-m", "ringd.app.ctl", "top"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "ringctl status --json" in r.stderr


def render(view) -> str:
    from rich.console import Console

    console = Console(width=160, record=True, file=open(os.devnull, "w"))
    console.print(view)
    return console.export_text()


def test_top_draws_live_figures_and_loading_progress_when_the_document_has_them(capsys):
    """A status document written here stands in for a node's: every live figure a node may report
    (the daemon adds them as it learns to measure them), and odd values of them."""
    doc = {
        "leader": "mini1",
        "ready": False,
        "reason": "waiting for studio to load its layers",
        "plan": {"term": 7},
        "nodes": [
            {
                "node": "mini1", "role": "leader", "stage": 0, "layers": [0, 14], "ready": True,
                "parameter_bytes": 3 * 2**30, "kv_bytes": 2**20, "kv_capacity": 4 * 2**30, "budget": 8 * 2**30,
                "sessions": 2, "active_requests": 1, "queued_requests": 3, "term": 7,
                "stats": {"tokens_per_s": 41.25, "ttft_s": None, "active_requests": 1, "queued_requests": 3, "requests_total": 1200, "tokens_out_total": 98765,
                          "micro_batches": 2, "draft_acceptance": 0.8},
            },
            {
                "node": "studio", "role": "follower", "stage": 1, "layers": [14, 28], "ready": False, "term": 7,
                "progress": {"phase": "download", "bytes": 45 * 2**20, "total_bytes": 100 * 2**20, "rate_bytes_s": 12.5 * 2**20, "file": "model-00002.safetensors"},
                # A model loaded on demand beside it, its layers being read; another's entry garbled.
                "instance_stages": [{"instance": "qwen3-4b", "progress": {"phase": "load", "bytes": 3 * 2**20, "total_bytes": 4 * 2**20}},
                                    {"instance": "done", "progress": None}, "junk"],
            },
            {"node": "air", "ready": False, "error": "no answer: timed out", "progress": None, "stats": "not a mapping"},
        ],
    }  # fmt: skip
    text = render(top_view("10.0.0.1:8100", doc, None, time.time(), 3, 1.0))
    assert "leader mini1 · not ready: waiting for studio to load its layers · term 7" in text
    assert "tokens/s 41.2 · active 1 · queued 3 · requests 1,200 · tokens out 98,765 · micro-batches 2 · drafts kept 80%" in text and "TTFT" not in text
    assert re.search(r"studio\s+downloading\s+\S+\s+45%\s+45\.0 / 100\.0 MiB\s+12\.5 MiB/s\s+model-00002\.safetensors", text), text
    assert re.search(r"studio \(qwen3-4b\)\s+loading\s+\S+\s+75%\s+3\.0 / 4\.0 MiB", text), text
    assert "no answer: timed out" in text and "3,072.0" in text and "1.0 / 4,096.0" in text

    # `ringctl status` prints the same figures and progress once, under its table, and the
    # leader's models besides the configured one, a loading one with why it is not ready.
    doc["nodes"][0]["instances"] = [
        {"instance": "", "model": "tiny", "pinned": True, "ready": True, "stages": [["mini1", 0, 4]], "active": 1, "served": 9},
        {"instance": "qwen3-4b", "model": "qwen3-4b", "ready": False, "reason": "loading plan term 9; waiting for studio",
         "stages": [["studio", 0, 36]], "keep_alive": "5m0s"},
    ]  # fmt: skip
    print_status(doc)
    once = capsys.readouterr().out
    assert "tokens/s 41.2 · active 1 · queued 3 · requests 1,200 · tokens out 98,765 · micro-batches 2" in once
    assert re.search(r"studio\s+downloading\s+\S+\s+45%\s+45\.0 / 100\.0 MiB\s+12\.5 MiB/s\s+model-00002\.safetensors", once), once
    assert re.search(r"\nqwen3-4b\s+not ready: loading plan term 9; waiting for studio  ring studio\[0,36\)  .*keep_alive 5m0s", once), once

    # Without the live fields nothing of them is drawn; a failed poll keeps the last answer under the error.
    plain = {"leader": "mini1", "ready": True, "plan": None, "nodes": [{"node": "mini1", "ready": True}]}
    text = render(top_view("10.0.0.1:8100", plain, "cannot read http://10.0.0.1:8100/cluster/status: refused", time.time() - 5, 9, 1.0))
    assert "tokens/s" not in text and "downloading" not in text and "no plan yet" in text
    assert "cannot read http://10.0.0.1:8100/cluster/status: refused\nretrying every 1 s; the table is the answer of" in text
    assert "mini1" in text


class FakeNode:
    """An HTTP server on loopback that says it is node ``claim`` and answers ringctl as a node
    would; ``requests`` holds (method, path, headers) of everything that reached it."""

    def __init__(self, claim: str):
        self.claim = claim
        self.requests: list[tuple[str, str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, doc: dict) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                fake.requests.append((self.command, self.path, dict(self.headers)))
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                node = {"node": fake.claim, "role": "leader", "ready": True}
                self._answer({"status": "ok", **node} if self.path == "/health" else {"leader": fake.claim, "ready": True, "plan": None, "nodes": [node]})

            def do_POST(self):
                self._answer({"drained": [], "pin": [9, None], "leader": fake.claim})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def signed(self) -> list[tuple[str, str, str]]:
        """(method, path, the node it was signed for) of each signed request that reached it."""
        return [(m, p, h.get("X-Ringd-Node")) for m, p, h in self.requests if "X-Ringd-Signature" in h]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_node():
    made: list[FakeNode] = []

    def make(claim: str) -> FakeNode:
        made.append(FakeNode(claim))
        return made[-1]

    yield make
    for f in made:
        f.close()


def ringctl_at(node: str, secret, *args: str) -> subprocess.CompletedProcess:
    """ringctl as a user runs it (the pin file: RINGD_KNOWN_NODES, a file of the test's own)."""
    cmd = [sys.executable, "-m", "ringd.app.ctl", "--node", node, "--secret-file", str(secret), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s" * 32)
    path.chmod(0o600)
    return path


def test_ringctl_signs_for_no_node_but_the_one_the_user_named(fake_node, secret, ringctl_known_nodes):
    fake = fake_node("studio")  # asked to drain through node0, a node that says it is studio answers
    for how in (["--node-name", "node0"], []):
        node = fake.addr if how else f"node0@{fake.addr}"
        r = ringctl_at(node, secret, *how, "drain", "mini")
        assert r.returncode == 1, r
        assert f"the node at {fake.addr} says it is 'studio', but you named 'node0'; nothing was signed" in r.stderr, r.stderr
    assert fake.signed() == [] and [m for m, _, _ in fake.requests] == ["GET", "GET"]  # /health only
    assert not ringctl_known_nodes.exists()

    fake.claim = "node0"  # the node the user named: signed for it, and pinned
    r = ringctl_at(fake.addr, secret, "--node-name", "node0", "drain", "mini")
    assert r.returncode == 0 and "drained: none" in r.stdout, r
    assert fake.signed() == [("POST", "/cluster/drain", "node0")]
    assert json.loads(ringctl_known_nodes.read_text()) == {fake.addr: "node0"}
    r = ringctl_at(f"node1@{fake.addr}", secret, "--node-name", "node0", "drain", "mini")
    assert r.returncode == 1 and "'node1'" in r.stderr and "'node0'" in r.stderr and "give one" in r.stderr, r


def test_ringctl_pins_the_name_it_first_signed_for_and_refuses_another(fake_node, secret, ringctl_known_nodes):
    fake = fake_node("node0")
    r = ringctl_at(fake.addr, secret, "status", "--json")  # signed with the secret: first contact
    assert r.returncode == 0 and json.loads(r.stdout)["leader"] == "node0", r
    assert f"says it is 'node0': pinned in {ringctl_known_nodes}" in r.stderr, r.stderr
    assert json.loads(ringctl_known_nodes.read_text()) == {fake.addr: "node0"}
    assert fake.signed() == [("GET", "/cluster/status", "node0")]

    # Another node now answers there (or something that wants a signature for node1): nothing signed.
    fake.claim = "node1"
    for args in (["leader", "set", "node1"], ["drain", "node2"], ["status"]):
        r = ringctl_at(fake.addr, secret, *args)
        assert r.returncode == 1, r
        assert f"the node at {fake.addr} says it is 'node1', but ringctl pinned it as 'node0'" in r.stderr, r.stderr
        assert str(ringctl_known_nodes) in r.stderr and "--node-name NAME" in r.stderr
    assert fake.signed() == [("GET", "/cluster/status", "node0")]

    # The user says it is node1 now: their word wins, and the pin follows it.
    r = ringctl_at(fake.addr, secret, "--node-name", "node1", "leader", "auto")
    assert r.returncode == 0 and "unpinned" in r.stdout and "was pinned as 'node0'; it is 'node1' now" in r.stderr, r
    assert fake.signed()[-1] == ("POST", "/cluster/leader", "node1")
    assert json.loads(ringctl_known_nodes.read_text()) == {fake.addr: "node1"}
    ringctl_known_nodes.write_text("[not a pin file")
    r = ringctl_at(fake.addr, secret, "drain", "node2")
    assert r.returncode == 1 and f"cannot use {ringctl_known_nodes}" in r.stderr and "delete it" in r.stderr, r


def test_plan_lists_a_group_its_ranks_and_what_its_all_reduces_run_on(capsys):
    from ringd.app.ctl.render import print_plan

    doc = {
        "leader": "mini1", "ready": True,
        "plan": {"term": 4, "leader": "mini1", "model": "abc", "num_layers": 8, "stages": [["mini1", "10.0.0.1:7100", 0, 8, [["mini2", "10.0.0.2:7100"]]]]},
        "nodes": [{"node": "mini1", "role": "leader", "engine": "jaccl"}, {"node": "mini2", "role": "follower", "engine": "jaccl"}],
    }  # fmt: skip
    print_plan(doc)
    out = capsys.readouterr().out
    assert "stage 0: a tensor-parallel group of 2, each member a 1/2 slice of every layer in [0, 8), all-reduces on jaccl" in out, out
    assert re.search(r"rank 0: mini1 .*\n.*rank 1: mini2 ", out), out
