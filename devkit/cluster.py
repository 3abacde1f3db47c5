"""`ringd serve` daemons started one by one, and what their /health says of the ring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from ringd.ring.statusdoc import ClusterStatus, NodeStatus
from ringd.base.servecmd import serve_command

from devkit import REPO, TEST_PREFILL_CHUNK
from devkit.ports import ports


class Cluster:
    """N `ringd serve` daemons started one by one, so a test can kill, stop and restart each.

    Ports are picked free on 127.0.0.1; every node gets every other as a static
    peer; state (election term, pin) lives under the test's tmp dir.
    """

    def __init__(self, model: Path, n: int, tmp: Path, extra: list[str] | None = None, static_peers: bool = True):
        self.model, self.n, self.tmp, self.extra = model, n, tmp, extra or []
        # Static peers (discovery off), or none and Bonjour on loopback only.
        self.static_peers = static_peers
        self.ring_ports = ports(n)
        self.http_ports = ports(n)
        self.secret = tmp / "secret"
        self.secret.write_text("s" * 32)
        self.secret.chmod(0o600)  # serve refuses a secret others can read
        self.cluster = f"test-{os.getpid()}-{tmp.name}"[:60]
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        for i in range(n):
            self.start(i)

    def name(self, i: int) -> str:
        return f"node{i}"

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http_ports[i]}"

    def flags(self, i: int, secret: Path | None = None, name: str | None = None) -> dict:
        """Node i's `ringd serve` flags as serve_command's keywords: a subclass adds or drops some
        (None leaves a flag out); ``extra`` comes after them, as written."""
        flags = dict(
            name=name or self.name(i), cluster=self.cluster, host="127.0.0.1", advertise="127.0.0.1", http_host="127.0.0.1",
            ring_port=self.ring_ports[i], http_port=self.http_ports[i], model=self.model, model_id="tiny",
            secret_file=secret or self.secret, state_dir=self.tmp / "state",
        )  # fmt: skip
        if self.static_peers:
            return {**flags, "discovery": False, "nodes": self.n, "peer": [self.peer_address(i, j) for j in self.peers_of(i)]}
        # Multicast on loopback only: a test never speaks mDNS on a real network.
        return {**flags, "mdns_interfaces": "lo"}

    def command(self, i: int, secret: Path | None = None, name: str | None = None) -> list[str]:
        return serve_command(**self.flags(i, secret=secret, name=name)) + self.extra

    def peer_address(self, i: int, j: int) -> str:
        """Where node i dials node j."""
        return f"127.0.0.1:{self.ring_ports[j]}"

    def peers_of(self, i: int) -> list[int]:
        """The nodes node i is given as static peers: by default every other one."""
        return [j for j in range(self.n) if j != i]

    def start(self, i: int) -> None:
        self.logs[i] = self.tmp / f"node{i}.log"
        log = open(self.logs[i], "a")
        env = dict(os.environ, RINGD_PREFILL_CHUNK_TOKENS=str(TEST_PREFILL_CHUNK))
        self.procs[i] = subprocess.Popen(self.command(i), cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)

    def signal(self, i: int, sig: int) -> None:
        self.procs[i].send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.procs[i].wait(30)

    def get(self, i: int, path: str) -> dict | None:
        """Node i's JSON answer to GET path, or None if it is down or not answering 200."""
        try:
            with urllib.request.urlopen(self.url(i) + path, timeout=3) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def status(self, i: int) -> dict | None:
        return self.get(i, "/cluster/status")

    def wait(self, predicate, timeout: float = 60, what: str = "the cluster to settle"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n" + self.log_tails())

    def log_tails(self) -> str:
        return "\n".join(f"--- node{i}\n" + p.read_text(errors="replace")[-2500:] for i, p in self.logs.items())

    def leader_ready(self, via: int) -> str | None:
        """The leader's name once the node `via` reports a ready ring."""
        s = ClusterStatus.parse(self.status(via))
        return s.leader if s.ready else None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def health(c, i: int) -> dict | None:
    return c.get(i, "/health")


def serving_leader(c, nodes) -> str | None:
    """The leader, once every node in `nodes` agrees on it and it answers /health with 200."""
    leaders = {NodeStatus.parse(health(c, i)).leader for i in nodes}
    if len(leaders) != 1 or None in leaders:
        return None
    leader = leaders.pop()
    h = NodeStatus.parse(health(c, int(leader.removeprefix("node"))))
    return leader if h.leading and h.ready else None
