"""``ringd local``: a ring of N daemon processes on this machine.

Each node is a separate OS process running ``ringd serve`` on 127.0.0.1 with
ports of its own and a cluster secret made for this run. This module starts
them, waits until the leader's ``/health`` says the ring is ready (printing the
nodes' download and load progress meanwhile, from ``/cluster/status``), prints the
API address, and on SIGINT or SIGTERM (or when any node dies) stops them all.
It is the launcher, not the daemon: everything it does goes through the same
``ringd serve`` a real cluster runs.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ringd.ring.statusdoc import ClusterStatus
from ringd.base import listeners
from ringd.base.names import DEFAULT_HTTP_PORT
from ringd.base.servecmd import Flag, serve_command
from ringd.models.ollama.keepalive import DEFAULT_KEEP_ALIVE_S

# Loading a model and linking N processes takes seconds; a minute of no
# progress means something is wrong, and the user should hear what.
READY_TIMEOUT_S = 180.0
READY_POLL_S = 0.2
# Grace for nodes to exit on SIGTERM before they are killed.
STOP_GRACE_S = 5.0
# While the ring gets ready, the leader's /cluster/status is read at most this often
# for the nodes' download and load progress: a line a second per loading node is
# as fast as a person reads, and the leader asks every node for each answer.
PROGRESS_POLL_S = 1.0
# Once ready, how often the launcher looks for nodes that exited, to say so.
SUPERVISE_POLL_S = 0.5


def _health(url: str, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def _cluster_status(url: str, context: ssl.SSLContext | None = None) -> dict:
    status, body = _health(url, context)
    return body if status == 200 and isinstance(body, dict) else {}


def progress_lines(doc: dict, shown: dict[str, dict]) -> list[str]:
    """A line for each node of a /cluster/status answer whose progress changed since ``shown``
    (node -> the progress last printed, updated here); nothing for nodes not loading."""
    from ringd.models.progress import describe

    lines = []
    for n in ClusterStatus.parse(doc).nodes:
        node, p = n.node, n.progress
        if p is None:
            shown.pop(node, None)
            continue
        if shown.get(node) != p:
            try:
                line = describe(p)
            except (TypeError, ValueError):  # a malformed status is no reason to stop the launcher
                continue
            shown[node] = p
            lines.append(f"ringd local: {node} {line}")
    return lines


class LaunchError(Exception):
    """What stops a launch, in words for the user; ``code`` is the launcher's exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def run_local(
    nodes: int,
    model: str,
    port: int = DEFAULT_HTTP_PORT,
    split: list[int] | None = None,
    host: str = "127.0.0.1",
    model_id: str | None = None,
    log_level: str = "info",
    draft_model: str | None = None,
    tls: str = "off",
    models_dir: str | None = None,
    replicas: int = 1,
    tensor_parallel: int | str = 1,
    tensor_engine: str = "auto",
    keep_alive: float | None = DEFAULT_KEEP_ALIVE_S,
) -> int:
    """``tls``: "auto" serves https with certificates from the run's cluster CA, written to
    ringd-ca.pem in the run's folder for clients to trust."""
    try:
        check_plan(model, nodes, split, tensor_parallel)
        rings, https = bind_listeners(nodes, host, port)
    except LaunchError as e:
        print(f"ringd local: {e}", file=sys.stderr)
        return e.code
    workdir = Path(tempfile.mkdtemp(prefix="ringd-local-"))
    secret_file = write_secret(workdir)
    # A cluster of its own: two `ringd local` runs on one machine never mix.
    cluster = f"local-{secrets.token_hex(4)}"
    context, ca_file = trust(tls, secret_file, cluster, workdir)
    # The same on every node: whichever leads plans with split, drafts, keeps the replicas and
    # loads from models_dir. Every node is listed as a peer: nothing to find, nothing to tell the LAN.
    shared: dict[str, Flag] = dict(
        model=model, secret_file=secret_file, cluster=cluster, state_dir=workdir, nodes=nodes, log_level=log_level,
        discovery=False, tls=tls, split=",".join(map(str, split)) if split else None, tensor_parallel=tensor_parallel, tensor_engine=tensor_engine, model_id=model_id,
        draft_model=draft_model, models_dir=models_dir, replicas=replicas,
        keep_alive="-1" if keep_alive is None else f"{keep_alive:g}s",
    )  # fmt: skip
    procs: list[subprocess.Popen] = []
    stop = Stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    api = f"{host}:{https[0].getsockname()[1]}"  # read now: the sockets go to the nodes, and close here
    url = f"{'https' if context else 'http'}://{api}"
    try:
        start_nodes(procs, rings, https, host, shared)
        body = wait_ready(procs, url, context, stop)
        if body is None:
            return 130
        # One line, how to trust the API included: whoever waits for it (a script, a test) has it all.
        trusted = (
            f"; TLS on: clients trust the cluster CA in {ca_file} (while this runs), e.g. curl --cacert {ca_file} {url}/health, "
            f"or SSL_CERT_FILE={ca_file} for the openai, anthropic and ollama clients"
        ) if context is not None else ""  # fmt: skip
        # ringctl reaches the ring with the run's own secret: the user's ~/.config/ringd/secret is not it.
        ctl = f"; ringctl reaches it as: ringctl --node {api} --secret-file {secret_file} ps"
        print(f"ringd: {nodes} node(s) ready; OpenAI API at {url}/v1 (model {body.get('model')}){trusted}{ctl}", flush=True)
        return supervise(procs, stop)
    except LaunchError as e:
        print(f"ringd local: {e}", file=sys.stderr)
        return e.code
    finally:
        # Stopping: a signal has nothing more to do here. Ignored, not handled: at exit Python
        # puts its handlers back to the default, and a second Ctrl-C (or `uv run` passing the
        # terminal's on) would then kill a launcher that stopped cleanly (exit -2, not 0).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for s in rings + https:
            s.close()  # those no node took, if a start failed
        stop_nodes(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def check_plan(model: str, nodes: int, split: list[int] | None, tensor_parallel: int | str = 1) -> None:
    """Fail fast and plainly where the leader's plan would: too few nodes, a model that cannot be
    read, a split that does not fit it, groups the nodes do not make or the model cannot split
    into. A Hub GGUF (OWNER/REPO:QUANT) is fetched here, whole,
    before any node starts: the lines its progress logs (models/progress.py) are printed as they come."""
    if nodes < 1:
        raise LaunchError("--nodes must be at least 1", code=2)
    if tensor_parallel == "auto":  # the leader chooses, by what it measures
        tensor_parallel = 1
    if nodes % tensor_parallel:
        raise LaunchError(f"--nodes {nodes} does not make whole groups of --tensor-parallel {tensor_parallel}", code=2)
    from ringd.ring.plan import PlacementError, make_plan
    from ringd.models.source import model_info
    from ringd.models.errors import ModelError

    shown = logging.StreamHandler(sys.stdout)
    shown.setFormatter(logging.Formatter("ringd local: %(message)s"))
    progress_log = logging.getLogger("ringd.models.progress")
    progress_log.addHandler(shown)
    progress_log.setLevel(logging.INFO)
    try:
        info = model_info(model)
        make_plan(0, "node0", info.fingerprint, info.num_layers, [(f"node{i}", "") for i in range(nodes // tensor_parallel)], split)
        if tensor_parallel > 1:
            from ringd.stage.shard import tensor_parallel_refusal

            refusal = tensor_parallel_refusal(info, tensor_parallel)
            if refusal is not None:
                raise LaunchError(f"--tensor-parallel {tensor_parallel}: {refusal}", code=2)
    except (ModelError, PlacementError) as e:
        raise LaunchError(str(e), code=2) from None
    finally:
        progress_log.removeHandler(shown)


def bind_listeners(nodes: int, host: str, port: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """Every node's ring and API listeners, bound here and handed down (listeners.py): no port is
    free between its choice and its use. The API of node0 on ``port``, the rest where the kernel says."""
    rings: list[socket.socket] = []
    https: list[socket.socket] = []
    try:
        for i in range(nodes):
            rings.append(listeners.bind("127.0.0.1"))
            https.append(listeners.bind(host, port if i == 0 else 0))
    except OSError as e:
        for s in rings + https:
            s.close()
        where = f"the API's port {host}:{port} (choose another with --port, or 0 for a free one)" if len(https) < len(rings) == 1 else f"node{len(https)}"
        raise LaunchError(f"cannot listen for {where}: {e.strerror}") from None
    return rings, https


def write_secret(workdir: Path) -> Path:
    """The run's cluster secret, readable by its owner only, as ``ringd serve`` requires."""
    secret_file = workdir / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    return secret_file


def trust(tls: str, secret_file: Path, cluster: str, workdir: Path) -> tuple[ssl.SSLContext | None, Path]:
    """With ``tls`` "auto": the cluster CA written to ringd-ca.pem for clients, and a context that
    trusts it for the launcher's own polls. Otherwise no context (plain HTTP)."""
    ca_file = workdir / "ringd-ca.pem"
    if tls != "auto":
        return None, ca_file
    from ringd.security.tls import cluster_ca_pem, trusting

    pem = cluster_ca_pem(secret_file.read_bytes().strip(), cluster)
    ca_file.write_bytes(pem)
    return trusting(pem), ca_file


def start_nodes(
    procs: list[subprocess.Popen], rings: list[socket.socket], https: list[socket.socket], host: str, shared: dict[str, Flag]
) -> None:
    """One ``ringd serve`` per pair of listeners, appended to ``procs`` as it starts (so that a
    failed start still stops those already running). Each node inherits its listeners and dials
    every other node's ring port; ``shared`` are the flags every node gets."""
    env = dict(os.environ, RINGD_EXIT_WITH_PARENT=str(os.getpid()))
    ring_ports = [s.getsockname()[1] for s in rings]
    for i, (ring, http) in enumerate(zip(rings, https)):
        cmd = serve_command(
            name=f"node{i}", host="127.0.0.1", advertise="127.0.0.1",
            ring_port=ring_ports[i], ring_fd=ring.fileno(),
            http_host=host, http_port=http.getsockname()[1], http_fd=http.fileno(),
            peer=[f"127.0.0.1:{p}" for j, p in enumerate(ring_ports) if j != i], **shared,
        )  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=(ring.fileno(), http.fileno())))
        # The node holds its listeners now: when it exits, they close (peers see it refuse).
        ring.close()
        http.close()


class Stop:
    """Set by a signal handler, waited for by the launcher's loops. Not a threading.Event: its
    ``set`` takes the lock its ``wait`` holds for a moment on waking, and a handler runs on the
    thread that waits, between any two bytecodes: a signal landing in that moment (a second
    Ctrl-C, SIGTERM after SIGINT) would wait on its own thread's lock for ever."""

    # How long a wait sleeps before looking again: how late a stop may be seen.
    STEP_S = 0.05

    def __init__(self):
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether set, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(self.STEP_S, left))
        return self._set


def wait_ready(procs: list[subprocess.Popen], url: str, context: ssl.SSLContext | None, stop: Stop) -> dict | None:
    """The leader's /health answer once the ring serves, printing the nodes' download and load
    progress meanwhile; None if stopped first. A node that exits, or no ring after
    READY_TIMEOUT_S, is a LaunchError that says which node or what the leader last said."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    reason = ""
    shown: dict[str, dict] = {}
    polled_at = float("-inf")
    while not stop.is_set():
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise LaunchError(f"node{dead[0]} exited with code {procs[dead[0]].returncode}")
        status, body = _health(url + "/health", context)
        if status == 200:
            return body
        reason = body.get("reason", reason)
        if time.monotonic() - polled_at >= PROGRESS_POLL_S:
            polled_at = time.monotonic()
            for line in progress_lines(_cluster_status(url + "/cluster/status", context), shown):
                print(line, flush=True)
        if time.monotonic() > deadline:
            raise LaunchError(f"the ring was not ready after {READY_TIMEOUT_S:.0f} s: {reason}")
        stop.wait(READY_POLL_S)
    return None


def supervise(procs: list[subprocess.Popen], stop: Stop) -> int:
    """Until stopped (0), or every node has exited (1). A node that dies is the ring's business
    (it re-plans over the others): the launcher only says so."""
    reported: set[int] = set()
    while not stop.wait(SUPERVISE_POLL_S):
        for i, p in enumerate(procs):
            if p.poll() is not None and i not in reported:
                reported.add(i)
                print(f"ringd local: node{i} exited with code {p.returncode}", file=sys.stderr, flush=True)
        if len(reported) == len(procs):
            print("ringd local: every node has exited", file=sys.stderr)
            return 1
    return 0


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every node still running, then SIGKILL to any not gone within STOP_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
