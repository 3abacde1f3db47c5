"""``ringctl``: look at a running ring from any node's HTTP port.

``ringctl status`` prints the cluster as the node asked sees it: every node, its
address, role, stage and layers, parameter and KV memory, live sessions, the
plan term it runs and its readiness; linked nodes outside the ring too
the leader's throughput and any model download or load under way, with
its file, bytes and rate (``--json`` for the raw document); ``plan`` the ring's order and layer ranges;
``leader set NODE`` pins the leader (the pin outlives restarts) and ``leader
auto`` unpins; ``drain NODE`` keeps a node out of the ring (``--undo`` takes it
back); ``models`` lists every model the node could serve (the Ollama store, the
Hugging Face cache, its ``models_dir``; the loaded one marked) with its size,
quant and architecture, and whether the cluster's memory holds it. It talks HTTP to any one node (``--node HOST:PORT``, default the local
daemon) and never to the ring port.

A node with TLS on answers plain HTTP with a 400 that says so; ringctl then
speaks https to it (or at once, given ``--node https://HOST:PORT``), trusting
``--ca FILE``, or else the cluster CA it derives from the secret and the
cluster's name (``--cluster``). ``tls-ca`` prints that CA, for clients to
trust: it needs only the secret.

Control verbs (leader, drain) change the cluster, so ringctl signs them with
the cluster secret (``--secret-file``, by default where ``ringd serve`` looks;
``auth.py`` has the scheme); without it a node refuses them. ``status`` and
``plan`` on a node with API keys need a key (``--api-key`` or RINGD_API_KEY) or
the secret.

A signature is for one node, by name. The name is the user's when given
(``--node-name NAME``, or ``--node NAME@HOST:PORT``); otherwise ringctl takes
what the node's open ``/health`` says the first time it signs for that
address and pins it (``--known-nodes``, as ssh pins host keys). Either way, a
node whose answer names another node gets nothing signed, and the error names
both: a fake node cannot have ringctl sign for a node it is not.

``top`` is ``status`` redrawn live, with the leader's throughput and each
node's model download/load progress when the node reports them.

``install --config FILE`` makes ``ringd serve`` a service of this machine (a
launchd job on macOS, a systemd unit on Linux; ``service.py`` builds it),
``uninstall`` takes it out, ``logs`` shows its log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ringd import service
from ringd.cluster.sharing import MAX_REPLICAS
from ringd.config import DEFAULT_SECRET_FILE, KEYS, ConfigError, read_secret_file
from ringd.tls import TlsError, cluster_ca_pem, trusting
from ringd.auth import sign
from ringd.models import progress
from ringd.names import DEFAULT_HTTP_PORT, check_name

DEFAULT_NODE = f"127.0.0.1:{DEFAULT_HTTP_PORT}"
# Where ringctl pins the name of each node it has signed for (HOST:PORT -> name), beside
# ringd's own state.
DEFAULT_KNOWN_NODES = "~/.local/state/ringd/ringctl-nodes.json"
# A node answers status from memory; seconds of silence mean it is down or stuck.
HTTP_TIMEOUT_S = 5.0
# `ringctl load` waits while the leader places the model and the nodes read their layers: a
# large model from a Mac's SSD takes a minute or two (the leader's own bound is pool.LOAD_TIMEOUT_S).
LOAD_TIMEOUT_S = 600.0
# `top` redraws once a second by default: live enough for a person watching.
TOP_INTERVAL_S = 1.0
# Each poll asks every node over the ring for its status; faster than this shows
# nothing a person can read and only loads the cluster.
MIN_TOP_INTERVAL_S = 0.1
# `logs` without -f: the last lines, about a screenful.
LOG_LINES = 50
# launchctl and systemctl answer in well under a second; a minute only trips on
# a service manager that is wedged (bootout waits for the old daemon to stop).
SERVICE_COMMAND_TIMEOUT_S = 60.0


class CtlError(Exception):
    pass


class KnownNodes:
    """The name ringctl signs for at each address, pinned the first time (a JSON object, HOST:PORT -> name)."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser()

    def _fix(self, why: str) -> CtlError:
        return CtlError(f"cannot use {self.path} ({why}); ringctl pins node names there: fix the file or delete it")

    def load(self) -> dict[str, str]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise self._fix(str(e)) from None
        if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
            raise self._fix("not a JSON object of HOST:PORT to a name")
        return doc

    def pin(self, node: str, name: str) -> None:
        pins = {**self.load(), node: name}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
            os.replace(partial, self.path)  # never half a file
        except OSError as e:
            raise self._fix(str(e)) from None


DEFAULT_CLUSTER = next(k.default for k in KEYS if k.name == "cluster")
# The start of the 400 a node with TLS on gives plain HTTP (http/tlslisten.py).
SPEAKS_HTTPS = b"this node speaks HTTPS"


class Trust:
    """How ringctl reaches a node's API: plain HTTP, or https checked against ``ca_file``, else
    against the cluster CA derived from the secret (``secret()``) and the cluster's name."""

    def __init__(self, https: bool, ca_file: str | None, cluster: str, secret):
        self.https, self.ca_file, self.cluster, self._secret = https, ca_file, cluster, secret
        self._context: ssl.SSLContext | None = None

    def url(self, node: str, path: str) -> str:
        return f"{'https' if self.https else 'http'}://{node}{path}"

    def context(self) -> ssl.SSLContext | None:
        if not self.https:
            return None
        if self._context is None:
            if self.ca_file is not None:
                try:
                    pem = Path(self.ca_file).expanduser().read_bytes()
                    self._context = trusting(pem)
                except OSError as e:
                    raise CtlError(f"--ca: cannot read {self.ca_file}: {e.strerror}") from None
                except TlsError as e:
                    raise CtlError(f"--ca: {self.ca_file}: {e}") from None
            else:
                secret = self._secret()
                if secret is None:
                    raise CtlError(
                        "the node speaks HTTPS; trust its certificate with --ca FILE, or give the cluster secret "
                        "(--secret-file) and ringctl checks it against the cluster CA"
                    )
                self._context = trusting(cluster_ca_pem(secret, self.cluster))
        return self._context

    def failed(self, url: str, e: ssl.SSLCertVerificationError) -> "CtlError":
        how = (
            f"is --ca {self.ca_file} the CA that issued it?" if self.ca_file is not None
            else f"with tls: auto, --secret-file must hold the cluster's secret and --cluster name it (now {self.cluster!r}); "
            "with the node's own tls_cert, give its CA: --ca FILE"
        )  # fmt: skip
        return CtlError(f"{url}: the node's certificate did not verify ({e.verify_message}); {how}")


class Credentials:
    """What ringctl proves itself with: the cluster secret (read when first needed), an API key;
    and for which node it signs at each address (``named``: the user's word, else ``known``'s pin)."""

    def __init__(
        self, secret_file: str | None, api_key: str | None, known: KnownNodes | None = None, named: dict[str, str] | None = None,
        trust: Trust | None = None,
    ):  # fmt: skip
        self.secret_file = secret_file
        self.api_key = api_key
        self.trust = trust or Trust(False, None, DEFAULT_CLUSTER, lambda: self.secret(required=False))
        self.known = known or KnownNodes(DEFAULT_KNOWN_NODES)
        self.named = named or {}
        self._secret: bytes | None = None
        self._node_names: dict[str, str] = {}

    def secret(self, required: bool) -> bytes | None:
        if self._secret is None:
            path = self.secret_file or DEFAULT_SECRET_FILE
            try:
                self._secret = read_secret_file(path)
            except ConfigError as e:
                if required or self.secret_file:
                    raise CtlError(f"{e}; control commands are signed with the cluster secret (--secret-file FILE)") from None
                return None
        return self._secret

    def node_name(self, node: str) -> str:
        """The name to sign for at ``node``: the user's, else the pinned one, else (first contact) what
        the node says, then pinned. The node's open /health must say the same, or nothing is signed."""
        if node in self._node_names:
            return self._node_names[node]
        claimed = fetch(node, "/health", allow_error=True, trust=self.trust).get("node")
        claim = f"says it is {claimed!r:.80}" if isinstance(claimed, str) else "does not say which node it is"
        pinned = self.known.load().get(node)
        named = self.named.get(node)
        if named is not None:
            if claimed != named:
                raise CtlError(f"the node at {node} {claim}, but you named {named!r}; nothing was signed: is --node the address you meant?")
            if pinned is not None and pinned != named:
                print(f"ringctl: {node} was pinned as {pinned!r}; it is {named!r} now, as you named it ({self.known.path})", file=sys.stderr)
        elif pinned is not None:
            if claimed != pinned:
                raise CtlError(
                    f"the node at {node} {claim}, but ringctl pinned it as {pinned!r} when it first signed for it "
                    f"({self.known.path}); nothing was signed. If another node now answers there, say which you mean: "
                    f"--node-name NAME (or --node NAME@{node})"
                )
        else:
            try:
                check_name(claimed)
            except ValueError:
                raise CtlError(f"the node at {node} {claim} (a node name); name it yourself: --node-name NAME") from None
            print(
                f"ringctl: first signed request to {node}, which says it is {claimed!r}: pinned in {self.known.path}; "
                "ringctl will sign for no other name there",
                file=sys.stderr,
            )  # fmt: skip
        name = named or pinned or claimed
        if pinned != name:
            self.known.pin(node, name)
        self._node_names[node] = name
        return name


def fetch(
    node: str, path: str, body: dict | None = None, creds: Credentials | None = None, sign_with_secret: bool = False,
    allow_error: bool = False, trust: Trust | None = None, timeout_s: float = HTTP_TIMEOUT_S,
) -> dict:  # fmt: skip
    trust = trust or (creds.trust if creds is not None else Trust(False, None, DEFAULT_CLUSTER, lambda: None))
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if creds is not None:
        secret = creds.secret(required=sign_with_secret)
        if secret is not None:
            method = "GET" if data is None else "POST"
            headers.update(sign(secret, method, path, creds.node_name(node), data or b"", time.time()))
        elif creds.api_key:
            headers["Authorization"] = f"Bearer {creds.api_key}"
    while True:
        url = trust.url(node, path)
        req = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=trust.context()) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            if e.code == 400 and raw.startswith(SPEAKS_HTTPS) and not trust.https:
                trust.https = True  # and for every later request of this run
                continue
            if allow_error:
                try:
                    return json.loads(raw)
                except ValueError:
                    return {}
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:300].decode(errors="replace")
            raise CtlError(f"{url} answered {e.code}: {message}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):
                raise trust.failed(url, e.reason) from None
            raise CtlError(f"cannot read {url}: {e.reason}; is ringd running there? (--node HOST:PORT)") from None
        except (OSError, ValueError) as e:
            raise CtlError(f"cannot read {url}: {e}; is ringd running there? (--node HOST:PORT)") from None


def _number(v) -> float | None:
    """A figure from a status document, or None if it is absent or not a number (fields come and go)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _mib(n) -> str:
    n = _number(n)
    return "-" if n is None else f"{n / 2**20:,.1f}"


def print_models(doc: dict) -> None:
    """``ringctl models``: one row a model, the loaded one marked, then why any cannot run."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    table = Table(title=f"models on {doc.get('node') or '?'}")
    for col in ("", "name", "source", "format", "quant", "arch", "layers", "size MiB", "fits"):
        table.add_column(col, justify="right" if col in ("layers", "size MiB") else "left", no_wrap=col == "name")
    notes = []
    for m in doc.get("models") or []:
        if not isinstance(m, dict):
            continue
        fits = {True: "yes", False: "no", None: "-"}.get(m.get("fits"), "-")
        if m.get("error"):
            fits = "cannot serve"
            notes.append(f"{m.get('name')}: {m['error']}")
        elif m.get("fits") is False:
            notes.append(f"{m.get('name')}: {m.get('fit')}")
        table.add_row(
            "●" if m.get("loaded") else "", str(m.get("name", "?")), str(m.get("source") or "-"), str(m.get("format") or "-"),
            str(m.get("quant") or "-"), str(m.get("architecture") or "-"), str(m.get("layers") or "-"), _mib(m.get("size")), fits,
        )  # fmt: skip
    console.print(table)
    for line in notes:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if doc.get("truncated"):
        console.print("(the list stopped short: more models are on disk than one listing reads)", markup=False)


def _layers(n: dict) -> str:
    layers = n.get("layers")
    return f"[{layers[0]}, {layers[1]})" if isinstance(layers, list) and len(layers) == 2 else "-"


def _drained(doc: dict) -> set[str]:
    # Every node keeps the leader's drain list; the union still holds when the leader is silent.
    out: set[str] = set()
    for n in doc.get("nodes", []):
        if isinstance(n.get("drained"), list):
            out.update(x for x in n["drained"] if isinstance(x, str))
    return out


def _health(n: dict, drained: set[str]) -> str:
    # A drained node may well be ready (it forwards the API), but it holds no layers: say that.
    if n.get("node") in drained:
        return "drained"
    return "ready" if n.get("ready") else n.get("error") or "not ready"


def print_status(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped or captured: keep whole rows instead of rich's 80 columns
    title = f"ring term {doc['plan']['term']}" if doc.get("plan") else "no plan yet"
    table = Table(title=f"{title} — leader {doc.get('leader') or '?'}")
    numeric = ("stage", "budget MiB", "params MiB", "KV MiB", "speed", "sessions", "term")
    columns = ("node", "address", "role", "stage", "layers", "budget MiB", "params MiB", "KV MiB", "speed", "sessions", "term", "health")
    for col in columns:
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col in ("node", "address"))
    drained = _drained(doc)
    for n in doc.get("nodes", []):
        table.add_row(
            n.get("node", "?"),
            n.get("addr", "-"),
            n.get("role", "-"),
            "-" if n.get("stage") is None else str(n["stage"]),
            _layers(n),
            _mib(n.get("budget")),
            _mib(n.get("parameter_bytes")),
            f"{_mib(n.get('kv_bytes'))} / {_mib(n.get('kv_capacity'))}",
            "-" if _number(n.get("speed")) is None else f"{n['speed']:.1f}",
            str(n.get("sessions", "-")),
            str(n.get("term") or "-"),
            _health(n, drained),
        )
    console.print(table)
    # What top shows live, once: the leader's figures and any download or load under way.
    stats = _stats_line(doc)
    if stats:
        console.print(stats, markup=False)
    loading = _progress_grid(doc)
    if loading is not None:
        console.print(loading)
    # Models besides the configured one (loaded on demand, replicas), each with its state: loading ones say why.
    rows = instances_of(doc)
    if len(rows) > 1:
        console.print("models:", *instance_lines(rows), sep="\n", markup=False, highlight=False)
    if not doc.get("ready"):
        console.print(f"[bold red]not serving:[/] {doc.get('reason') or 'unknown'}")


def print_plan(doc: dict) -> None:
    plan = doc.get("plan")
    if not plan:
        print(f"no plan yet: {doc.get('reason') or 'waiting'}")
        return
    nodes = {n.get("node"): n for n in doc.get("nodes", [])}
    print(f"plan {plan['term']} by {plan['leader']}, model {plan['model']}, {plan['num_layers']} layers")
    for i, (node, addr, start, end) in enumerate(plan["stages"]):
        n = nodes.get(node, {})
        speed = "-" if n.get("speed") is None else f"{n['speed']:.1f} GFLOP/s"
        print(
            f"  stage {i}: {node:<16} {addr:<22} layers [{start}, {end})  ({end - start})  "
            f"budget {_mib(n.get('budget'))} MiB, weights {_mib(n.get('parameter_bytes'))} MiB, "
            f"KV {_mib(n.get('kv_bytes'))} of {_mib(n.get('kv_capacity'))} MiB, speed {speed}"
        )
    for line in layout_lines(next((n.get("layout") for n in nodes.values() if n.get("role") == "leader" and n.get("layout")), None)):
        print(line)


def layout_lines(layout: dict | None) -> list[str]:
    """The ring's links as the leader measured them (each hop's RTT and bandwidth, the token's
    link cost) and each Mac left out with why."""
    if not isinstance(layout, dict):
        return []

    def hop(h) -> str:
        a, b, rtt, rate = h
        if rtt is None:
            return f"{a} -> {b}: not measured yet"
        bw = "" if rate is None else f", {rate * 8 / 1e6:.0f} Mb/s"
        return f"{a} -> {b}: RTT {rtt / 1000:.2f} ms{bw}"

    lines = []
    if layout.get("hops"):
        lines.append(f"links ({layout.get('cost_us', 0) / 1000:.2f} ms a token around the ring):")
        lines += [f"  {hop(h)}" for h in layout["hops"]]
    lines += [str(o.get("why")) for o in layout.get("left_out") or []]
    return lines


def instances_of(doc: dict) -> list[dict]:
    """The leader's instances, from a cluster status document."""
    for n in doc.get("nodes", []):
        if n.get("role") == "leader" and isinstance(n.get("instances"), list):
            return n["instances"]
    return []


def instance_lines(rows: list[dict]) -> list[str]:
    """One line per instance the leader serves: model, state (or why it is still loading), ring,
    requests, keep_alive."""
    lines = []
    for r in rows:
        name = r.get("instance") or r.get("model") or "?"
        state = "ready" if r.get("ready") else f"not ready: {r.get('reason') or '?'}"
        ring = " -> ".join(f"{node}[{a},{b})" for node, a, b in r.get("stages") or []) or "-"
        keep = "pinned" if r.get("pinned") else f"keep_alive {r.get('keep_alive')}"
        lines.append(
            f"{name:<32} {state}  ring {ring}  active {r.get('active', 0)}, queued {r.get('queued', 0)}, "
            f"served {r.get('served', 0)}  {keep}"
        )
    return lines


def print_instances(rows: list[dict]) -> None:
    print("\n".join(instance_lines(rows)) if rows else "no instances (no leader answered, or it serves nothing yet)")


# ---- top: the status, redrawn live ----

# The leader's live figures ("stats" in its node entry), as top shows them.
_STATS = (
    ("tokens_per_s", "tokens/s", "{:,.1f}"),
    ("ttft_s", "TTFT", "{:.2f} s"),
    ("active_requests", "active", "{:,.0f}"),
    ("queued_requests", "queued", "{:,.0f}"),
    ("requests_total", "requests", "{:,.0f}"),
    ("tokens_out_total", "tokens out", "{:,.0f}"),
    ("micro_batches", "micro-batches", "{:,.0f}"),
    ("draft_acceptance", "drafts kept", "{:.0%}"),
)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _stats_line(doc: dict) -> str | None:
    leader = next((n for n in doc.get("nodes", []) if n.get("node") == doc.get("leader")), None)
    stats = leader.get("stats") if leader else None
    if not isinstance(stats, dict):
        return None
    parts = [f"{label} {fmt.format(_number(stats[key]))}" for key, label, fmt in _STATS if _number(stats.get(key)) is not None]
    return " · ".join(parts) or None


def _progress_grid(doc: dict):
    """One line per node that is downloading or loading its layers, or None."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    for n in doc.get("nodes", []):
        p = n.get("progress")
        if not isinstance(p, dict):
            continue
        done, total, rate = _number(p.get("bytes")), _number(p.get("total_bytes")), _number(p.get("rate_bytes_s"))
        figures = [f"{done / total:.0%}" if done is not None and total else "", f"{_mib(done)} / {_mib(total)} MiB"]
        if rate is not None:
            figures.append(f"{_mib(rate)} MiB/s")
        if isinstance(p.get("file"), str):
            figures.append(p["file"])
        # No total yet: rich draws an indeterminate bar.
        bar = ProgressBar(total=total if total else None, completed=done or 0, width=24)
        grid.add_row(str(n.get("node", "?")), progress.verb(p.get("phase")), bar, "  ".join(f for f in figures if f))
    return grid if grid.row_count else None


def top_view(node: str, doc: dict | None, error: str | None, seen_at: float | None, polls: int, interval: float):
    """What `ringctl top` draws: the header, the nodes, live figures. ``doc`` is the last answer (kept when one fails)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list = []
    header = Text()
    if doc is not None:
        header.append(f"leader {doc.get('leader') or '?'}", style="bold")
        header.append(" · ")
        if doc.get("ready"):
            header.append("ready", style="bold green")
        else:
            header.append(f"not ready: {doc.get('reason') or 'unknown'}", style="bold red")
        plan = doc.get("plan")
        header.append(f" · term {plan.get('term')}" if isinstance(plan, dict) else " · no plan yet")
    header.append(f"    {node} · {_clock(time.time())} · poll {polls}, every {interval:g} s", style="dim")
    parts.append(header)
    if error is not None:
        parts.append(Text(error, style="bold red"))
        since = f"; the table is the answer of {_clock(seen_at)}" if seen_at is not None else ""
        parts.append(Text(f"retrying every {interval:g} s{since}", style="yellow"))
    if doc is None:
        return Group(*parts)

    table = Table(expand=False)
    columns = ("node", "role", "stage", "layers", "weights MiB", "KV MiB", "budget MiB", "sessions", "active", "queued", "term", "health")
    numeric = ("stage", "weights MiB", "KV MiB", "budget MiB", "sessions", "active", "queued", "term")
    for col in columns:
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col != "health")
    drained = _drained(doc)
    for n in doc.get("nodes", []):
        health = _health(n, drained)
        table.add_row(
            str(n.get("node", "?")),
            str(n.get("role", "-")),
            "-" if n.get("stage") is None else str(n["stage"]),
            _layers(n),
            _mib(n.get("parameter_bytes")),
            f"{_mib(n.get('kv_bytes'))} / {_mib(n.get('kv_capacity'))}",
            _mib(n.get("budget")),
            str(n.get("sessions", "-")),
            str(n.get("active_requests", "-")),
            str(n.get("queued_requests", "-")),
            str(n.get("term") or "-"),
            Text(health, style="green" if health == "ready" else "yellow" if health == "drained" else "red"),
        )
    parts.append(table)
    stats = _stats_line(doc)
    if stats:
        parts.append(Text(stats))
    loading = _progress_grid(doc)
    if loading is not None:
        parts.append(loading)
    return Group(*parts)


def top(node: str, creds: Credentials, interval: float) -> int:
    """Poll the node's /cluster/status every ``interval`` s and redraw, until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:
        raise CtlError("top draws in a terminal; for a script use: ringctl status --json")
    if creds.secret(required=False) is not None:  # a --secret-file that cannot be read is an error now, not on every poll
        try:
            creds.node_name(node)  # first contact's note on the terminal, not under the live screen
        except CtlError:
            pass  # the node is down, or says it is another: top shows that and keeps asking
    doc, error, seen_at, polls = None, None, None, 0
    try:
        # The alternate screen, as top(1): the shell's screen comes back on exit.
        with Live(top_view(node, None, None, None, 0, interval), console=console, screen=True, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                try:
                    doc, error, seen_at = fetch(node, "/cluster/status", creds=creds), None, time.time()
                except CtlError as e:
                    error = str(e)  # keep the last answer on screen, and keep asking
                polls += 1
                live.update(top_view(node, doc, error, seen_at, polls, interval), refresh=True)
                time.sleep(max(0.0, started + interval - time.monotonic()))
    except KeyboardInterrupt:
        return 0


# ---- install, uninstall, logs: ringd serve as a service (service.py) ----


def _service_command(svc: service.Service, argv: list[str], tolerate_not_loaded: bool = False) -> bool:
    """Run a launchctl/systemctl command; False if it failed only because the service was not loaded."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=SERVICE_COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise CtlError(f"{argv[0]} is not on PATH; {'launchd' if svc.platform == 'macos' else 'systemd'} runs services here") from None
    except subprocess.TimeoutExpired:
        raise CtlError(f"`{shlex.join(argv)}` did not finish within {SERVICE_COMMAND_TIMEOUT_S:g} s") from None
    if r.returncode == 0:
        return True
    output = (r.stderr + r.stdout).strip()
    if tolerate_not_loaded and svc.not_loaded(r.returncode, output):
        return False
    hint = ""
    if svc.platform == "macos" and "bootstrap" in argv:
        hint = f"; check the plist with: plutil -lint {shlex.quote(str(svc.file))}"
        if not svc.system:
            hint += "; a LaunchAgent needs its user logged in: for a Mac nobody logs in to, use sudo ringctl install --system"
    elif svc.platform == "linux" and not svc.system and "bus" in output.lower():
        hint = "; no systemd user manager is running for you: log in, or run sudo loginctl enable-linger $USER, or use --system"
    raise CtlError(f"`{shlex.join(argv)}` failed (exit {r.returncode}): {output or 'no output'}{hint}")


def _need_root(svc: service.Service, command: str) -> None:
    if svc.system and os.geteuid() != 0:
        ringctl = Path(os.path.abspath(sys.executable)).parent / "ringctl"
        raise CtlError(f"--system changes {svc.file}: run it as root: sudo {shlex.quote(str(ringctl))} {command}")


def _service_for(system: bool, user: str | None = None) -> tuple[service.Service, service.Account]:
    platform = service.host_platform()
    who = service.account(system, user)
    return service.locate(platform, system, who), who


def install(config: str, system: bool, user: str | None, print_only: bool) -> int:
    svc, who = _service_for(system, user)
    ringd = service.ringd_executable()
    config_file = Path(os.path.abspath(Path(config).expanduser()))
    env = service.environment(ringd.parent, who.home)
    job = service.job(ringd, config_file, env, svc.log, who.name if system else None)
    service.check_config(config_file, env, job.workdir)
    data = service.render(svc, job)
    if print_only:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return 0
    _need_root(svc, f"install --system --config {shlex.quote(str(config_file))}" + (f" --user {who.name}" if user else ""))
    if svc.file.exists():  # a reinstall: the old job goes first, or bootstrap finds the label taken
        for argv in svc.stop_commands():
            _service_command(svc, argv, tolerate_not_loaded=True)
    svc.log.parent.mkdir(parents=True, exist_ok=True)
    if system:  # the service's own account writes there
        shutil.chown(svc.log.parent, who.name)
    svc.file.parent.mkdir(parents=True, exist_ok=True)
    partial = svc.file.with_name(svc.file.name + ".partial")
    partial.write_bytes(data)
    partial.chmod(0o644)  # launchd refuses a job file that group or others may write
    os.replace(partial, svc.file)
    try:
        for argv in svc.start_commands():
            _service_command(svc, argv)
    except CtlError as e:
        raise CtlError(f"{e}\n(the service file is in place at {svc.file}; fix that and run ringctl install again, or ringctl uninstall)") from None
    kind = {("macos", False): "LaunchAgent", ("macos", True): "LaunchDaemon", ("linux", False): "systemd user unit", ("linux", True): "systemd unit"}
    sudo = "sudo " if system else ""
    flag = " --system" if system else ""
    print(f"installed {service.LABEL if svc.platform == 'macos' else service.UNIT} ({kind[svc.platform, system]}): {svc.file}")
    print(f"  runs    {shlex.join(job.program)}  (in {job.workdir}{f', as {who.name}' if system else ''})")
    print(f"  log     {svc.log}  (ringctl logs{flag} -f)")
    print(f"  remove  {sudo}ringctl uninstall{flag}")
    if svc.platform == "linux" and not system:
        print(f"  it runs while {who.name} is logged in; to start it at boot: sudo loginctl enable-linger {who.name} (or install --system)")
    return 0


def uninstall(system: bool) -> int:
    svc, _ = _service_for(system)
    _need_root(svc, "uninstall --system")
    installed = svc.file.exists()
    # launchd may still run a job whose plist was deleted by hand; systemd cannot disable a unit without its file.
    if installed or svc.platform == "macos":
        for argv in svc.stop_commands():
            _service_command(svc, argv, tolerate_not_loaded=True)
    if not installed:
        print(f"not installed: there is no {svc.file}")
        return 0
    svc.file.unlink()
    for argv in svc.cleanup_commands():
        _service_command(svc, argv)
    print(f"stopped and removed {svc.file}; its log stays at {svc.log}")
    return 0


def logs(system: bool, follow: bool, lines: int) -> int:
    svc, _ = _service_for(system)
    if not svc.log.exists():
        flag = " --system" if system else ""
        raise CtlError(
            f"no log at {svc.log}: the service has not run here yet; install it with: ringctl install{flag} --config FILE"
            + ("" if system else " (a --system service logs elsewhere: ringctl logs --system)")
        )
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), str(svc.log)]
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)  # tail follows (and survives the file being replaced) better than we would
    except OSError as e:
        raise CtlError(f"cannot run tail to show {svc.log}: {e}") from None
    return 0  # not reached


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= MIN_TOP_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TOP_INTERVAL_S} s (each poll asks every node)")
    return value


def _replicas(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"{text!r}: replicas must be a whole number from 1 to {MAX_REPLICAS}")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of lines")
    return int(text)


def _target(args) -> tuple[str, Credentials]:
    """--node as HOST:PORT, and what ringctl proves itself with there (the node's name, if the user gave it)."""
    node, name = args.node, args.node_name
    https = node.startswith("https://")
    node = node.removeprefix("https://").removeprefix("http://").rstrip("/")
    if "@" in node:
        given, node = node.split("@", 1)
        if name is not None and name != given:
            raise CtlError(f"--node says the node is {given!r:.80} and --node-name says {name!r:.80}: give one")
        name = given
    if name is not None:
        try:
            check_name(name)
        except ValueError as e:
            raise CtlError(f"{name!r:.80} is not a node name: {e}") from None
    known = KnownNodes(args.known_nodes or DEFAULT_KNOWN_NODES)
    creds = Credentials(args.secret_file, args.api_key, known, {node: name} if name is not None else None)
    creds.trust = Trust(https, args.ca, args.cluster, lambda: creds.secret(required=False))
    return node, creds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringctl", description="Inspect and steer a ringd cluster.")
    parser.add_argument(
        "--node", default=DEFAULT_NODE, metavar="[NAME@]HOST:PORT",
        help=f"any node's HTTP address (default {DEFAULT_NODE}); with NAME@, the node's name, as --node-name",
    )  # fmt: skip
    parser.add_argument("--node-name", metavar="NAME", help="the name of the node at --node: ringctl signs for it, and for no node that says it is another")
    parser.add_argument(
        "--known-nodes", default=os.environ.get("RINGD_KNOWN_NODES"), metavar="FILE",
        help=f"where ringctl pins the name of each node it signs for (default: RINGD_KNOWN_NODES, else {DEFAULT_KNOWN_NODES})",
    )  # fmt: skip
    parser.add_argument(
        "--secret-file", default=os.environ.get("RINGD_SECRET_FILE"),
        help=f"the cluster secret, to sign control commands (default: RINGD_SECRET_FILE, else {DEFAULT_SECRET_FILE})",
    )  # fmt: skip
    parser.add_argument("--api-key", default=os.environ.get("RINGD_API_KEY"), help="an API key, for status on a node that requires keys (default: RINGD_API_KEY)")
    parser.add_argument(
        "--cluster", default=os.environ.get("RINGD_CLUSTER", DEFAULT_CLUSTER),
        help=f"the cluster's name, which with the secret makes the cluster CA (tls-ca; https to a node with tls: auto); default: RINGD_CLUSTER, else {DEFAULT_CLUSTER}",
    )  # fmt: skip
    parser.add_argument("--ca", metavar="FILE", help="https: trust this CA (PEM) instead of the cluster CA derived from the secret")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="nodes, roles, layers, memory, health")
    status.add_argument("--json", action="store_true", help="print the raw status document")
    top_parser = sub.add_parser("top", help="the status, redrawn live, with throughput and loading progress (Ctrl-C quits)")
    top_parser.add_argument(
        "--interval", type=_interval, default=TOP_INTERVAL_S, metavar="SECONDS", help=f"seconds between polls (default {TOP_INTERVAL_S:g})"
    )
    sub.add_parser("plan", help="the ring's order and layer ranges")
    models = sub.add_parser("models", help="every model the node could serve, the loaded one marked, and whether the cluster's memory holds it")
    models.add_argument("--json", action="store_true", help="print the raw list")
    sub.add_parser("tls-ca", help="print the cluster CA (PEM) that nodes with tls: auto are issued by: clients trust this file")
    leader = sub.add_parser("leader", help="pin the leader (set NODE) or let the election decide (auto)")
    leader_sub = leader.add_subparsers(dest="action", required=True)
    leader_sub.add_parser("set", help="pin NODE as leader").add_argument("target", metavar="NODE")
    leader_sub.add_parser("auto", help="unpin: priority and name decide")
    sub.add_parser("ps", help="the models loaded now: each instance's ring, state, requests and keep_alive")
    load = sub.add_parser("load", help="load MODEL (a name the model list shows) and wait until it serves")
    load.add_argument("model", metavar="MODEL")
    load.add_argument("--replicas", type=_replicas, default=1, help="keep this many instances of it, each a ring of its own (default 1)")
    load.add_argument("--keep-alive", metavar="DURATION", help="how long it stays loaded once idle (5m, 1h, -1: forever; default: the leader's keep_alive)")
    unload = sub.add_parser("unload", help="unload MODEL (every instance of it) now")
    unload.add_argument("model", metavar="MODEL")
    drain = sub.add_parser("drain", help="keep NODE out of the ring")
    drain.add_argument("target", metavar="NODE")
    drain.add_argument("--undo", action="store_true", help="let NODE back into the ring")

    system_help = "the machine's boot-time service (a LaunchDaemon / system unit; needs sudo) instead of this user's"
    install_parser = sub.add_parser(
        "install", help="run `ringd serve --config FILE` as a service of this machine (launchd on macOS, systemd on Linux)"
    )
    install_parser.add_argument("--config", required=True, metavar="FILE", help="the node's YAML config (checked first)")
    install_parser.add_argument("--system", action="store_true", help=system_help + "; starts at boot, before anyone logs in")
    install_parser.add_argument("--user", metavar="NAME", help="with --system: the account ringd runs as (default: the user who ran sudo)")
    install_parser.add_argument("--print", action="store_true", help="print the plist / unit and change nothing")
    uninstall_parser = sub.add_parser("uninstall", help="stop the service and remove its file (the log stays)")
    uninstall_parser.add_argument("--system", action="store_true", help=system_help)
    logs_parser = sub.add_parser("logs", help="the service's log (ringd serve's output)")
    logs_parser.add_argument("-f", "--follow", action="store_true", help="keep printing lines as they are written (Ctrl-C stops)")
    logs_parser.add_argument("-n", "--lines", type=_positive, default=LOG_LINES, help=f"how many of the last lines (default {LOG_LINES})")
    logs_parser.add_argument("--system", action="store_true", help="the log of the boot-time service (install --system)")

    args = parser.parse_args(argv)
    try:
        args.node, creds = _target(args)
        if args.command == "tls-ca":
            sys.stdout.write(cluster_ca_pem(creds.secret(required=True), args.cluster).decode())
        elif args.command == "status":
            doc = fetch(args.node, "/cluster/status", creds=creds)
            print(json.dumps(doc, indent=2)) if args.json else print_status(doc)
        elif args.command == "top":
            return top(args.node, creds, args.interval)
        elif args.command == "models":
            doc = fetch(args.node, "/cluster/models", creds=creds)
            print(json.dumps(doc, indent=2)) if args.json else print_models(doc)
        elif args.command == "plan":
            print_plan(fetch(args.node, "/cluster/status", creds=creds))
        elif args.command == "leader":
            target = args.target if args.action == "set" else None
            answer = fetch(args.node, "/cluster/leader", {"node": target}, creds, sign_with_secret=True)
            print(f"pinned {target}" if target else "unpinned: the election decides", f"(pin epoch {answer['pin'][0]})")
        elif args.command == "ps":
            print_instances(instances_of(fetch(args.node, "/cluster/status", creds=creds)))
        elif args.command == "load":
            body = {"model": args.model, "replicas": args.replicas}
            if args.keep_alive is not None:
                body["keep_alive"] = args.keep_alive
            print_instances(fetch(args.node, "/cluster/load", body, creds, sign_with_secret=True, timeout_s=LOAD_TIMEOUT_S)["instances"])
        elif args.command == "unload":
            answer = fetch(args.node, "/cluster/unload", {"model": args.model}, creds, sign_with_secret=True)
            print(f"unloaded: {', '.join(answer['unloaded']) or 'nothing (not loaded, or the configured model)'}")
        elif args.command == "drain":
            answer = fetch(args.node, "/cluster/drain", {"node": args.target, "undo": args.undo}, creds, sign_with_secret=True)
            print(f"drained: {', '.join(answer['drained']) or 'none'}")
        elif args.command == "install":
            return install(args.config, args.system, args.user, args.print)
        elif args.command == "uninstall":
            return uninstall(args.system)
        elif args.command == "logs":
            return logs(args.system, args.follow, args.lines)
    except (CtlError, service.ServiceError) as e:
        print(f"ringctl: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # writing the service file or its log folder
        print(f"ringctl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
