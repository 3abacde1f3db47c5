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
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ringd import listeners
from ringd.names import DEFAULT_HTTP_PORT

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
    for n in doc.get("nodes") or []:
        if not isinstance(n, dict):
            continue
        node, p = str(n.get("node", "?")), n.get("progress")
        if not isinstance(p, dict):
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
) -> int:
    """``tls``: "auto" serves https with certificates from the run's cluster CA, written to
    ringd-ca.pem in the run's folder for clients to trust."""
    if nodes < 1:
        print("ringd local: --nodes must be at least 1", file=sys.stderr)
        return 2
    from ringd.ring.plan import PlacementError, make_plan
    from ringd.models.source import model_info
    from ringd.models.errors import ModelError

    # A Hub GGUF (OWNER/REPO:QUANT) is fetched here, whole, before any node starts: the lines its
    # progress logs (models/progress.py) are printed as they come.
    shown = logging.StreamHandler(sys.stdout)
    shown.setFormatter(logging.Formatter("ringd local: %(message)s"))
    progress_log = logging.getLogger("ringd.models.progress")
    progress_log.addHandler(shown)
    progress_log.setLevel(logging.INFO)
    try:
        info = model_info(model)
        # The leader makes this same plan; checking it here fails fast and plainly.
        make_plan(0, "node0", info.fingerprint, info.num_layers, [(f"node{i}", "") for i in range(nodes)], split)
    except (ModelError, PlacementError) as e:
        print(f"ringd local: {e}", file=sys.stderr)
        return 2
    finally:
        progress_log.removeHandler(shown)
    # Every node's listeners, bound here and handed down (listeners.py): no port is free
    # between its choice and its use. The API of node0 on --port, the rest where the kernel says.
    rings: list = []
    https: list = []
    try:
        for i in range(nodes):
            rings.append(listeners.bind("127.0.0.1"))
            https.append(listeners.bind(host, port if i == 0 else 0))
    except OSError as e:
        for s in rings + https:
            s.close()
        where = f"the API's port {host}:{port} (choose another with --port, or 0 for a free one)" if len(https) < len(rings) == 1 else f"node{len(https)}"
        print(f"ringd local: cannot listen for {where}: {e.strerror}", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="ringd-local-"))
    secret_file = workdir / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    # A cluster of its own: two `ringd local` runs on one machine never mix.
    cluster = f"local-{secrets.token_hex(4)}"
    context, ca_file = None, workdir / "ringd-ca.pem"
    if tls == "auto":
        from ringd.tls import cluster_ca_pem, trusting

        pem = cluster_ca_pem(secret_file.read_bytes().strip(), cluster)
        ca_file.write_bytes(pem)
        context = trusting(pem)

    ring_ports = [s.getsockname()[1] for s in rings]
    http_ports = [s.getsockname()[1] for s in https]
    env = dict(os.environ, RINGD_EXIT_WITH_PARENT=str(os.getpid()))
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    try:
        for i in range(nodes):
            cmd = [
                sys.executable, "-m", "ringd", "serve",
                "--name", f"node{i}",
                "--host", "127.0.0.1", "--advertise", "127.0.0.1",
                "--ring-port", str(ring_ports[i]), "--ring-fd", str(rings[i].fileno()),
                "--http-host", host, "--http-port", str(http_ports[i]), "--http-fd", str(https[i].fileno()),
                "--model", model, "--secret-file", str(secret_file),
                "--cluster", cluster, "--state-dir", str(workdir), "--nodes", str(nodes),
                "--log-level", log_level,
                # Every node is listed as a peer; nothing to find, and nothing to tell the LAN.
                "--discovery", "off", "--tls", tls,
            ]  # fmt: skip
            for j in range(nodes):
                if j != i:
                    cmd += ["--peer", f"127.0.0.1:{ring_ports[j]}"]
            if split:
                cmd += ["--split", ",".join(map(str, split))]
            if model_id:
                cmd += ["--model-id", model_id]
            if draft_model:  # on every node: whichever leads drafts
                cmd += ["--draft-model", draft_model]
            if models_dir:  # on every node: whichever leads loads from it, each node its layers
                cmd += ["--models-dir", models_dir]
            if replicas != 1:  # on every node: whichever leads keeps them
                cmd += ["--replicas", str(replicas)]
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=(rings[i].fileno(), https[i].fileno())))
            # The node holds its listeners now: when it exits, they close (peers see it refuse).
            rings[i].close()
            https[i].close()

        url = f"{'https' if context else 'http'}://{host}:{http_ports[0]}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        reason = ""
        shown: dict[str, dict] = {}
        polled_at = float("-inf")
        while not stop.is_set():
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                print(f"ringd local: node{dead[0]} exited with code {procs[dead[0]].returncode}", file=sys.stderr)
                return 1
            status, body = _health(url + "/health", context)
            if status == 200:
                break
            reason = body.get("reason", reason)
            if time.monotonic() - polled_at >= PROGRESS_POLL_S:
                polled_at = time.monotonic()
                for line in progress_lines(_cluster_status(url + "/cluster/status", context), shown):
                    print(line, flush=True)
            if time.monotonic() > deadline:
                print(f"ringd local: the ring was not ready after {READY_TIMEOUT_S:.0f} s: {reason}", file=sys.stderr)
                return 1
            stop.wait(READY_POLL_S)
        if stop.is_set():
            return 130
        # One line, how to trust the API included: whoever waits for it (a script, a test) has it all.
        trust = (
            f"; TLS on: clients trust the cluster CA in {ca_file} (while this runs), e.g. curl --cacert {ca_file} {url}/health, "
            f"or SSL_CERT_FILE={ca_file} for the openai, anthropic and ollama clients"
        ) if context is not None else ""  # fmt: skip
        print(f"ringd: {nodes} node(s) ready; OpenAI API at {url}/v1 (model {body.get('model')}){trust}", flush=True)
        # A node that dies now is the ring's business: it re-plans over the others.
        reported: set[int] = set()
        while not stop.wait(0.5):
            for i, p in enumerate(procs):
                if p.poll() is not None and i not in reported:
                    reported.add(i)
                    print(f"ringd local: node{i} exited with code {p.returncode}", file=sys.stderr, flush=True)
            if len(reported) == len(procs):
                print("ringd local: every node has exited", file=sys.stderr)
                return 1
        return 0
    finally:
        # Stopping: a signal has nothing more to do here. Ignored, not handled: at exit Python
        # puts its handlers back to the default, and a second Ctrl-C (or `uv run` passing the
        # terminal's on) would then kill a launcher that stopped cleanly (exit -2, not 0).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for s in rings + https:
            s.close()  # those no node took, if a start failed
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
        shutil.rmtree(workdir, ignore_errors=True)
