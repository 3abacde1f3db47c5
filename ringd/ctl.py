"""``ringctl``: look at a running ring from any node's HTTP port.

``ringctl status`` prints the cluster as the node asked sees it: every node, its
address, role, stage and layers, parameter and KV memory, live sessions, the
plan term it runs and its readiness; linked nodes outside the ring too
(``--json`` for the raw document); ``plan`` the ring's order and layer ranges;
``leader set NODE`` pins the leader (the pin outlives restarts) and ``leader
auto`` unpins; ``drain NODE`` keeps a node out of the ring (``--undo`` takes it
back). It talks HTTP to any one node (``--node HOST:PORT``, default the local
daemon) and never to the ring port.

Control verbs (leader, drain) change the cluster, so ringctl signs them with
the cluster secret (``--secret-file``, by default where ``ringd serve`` looks;
``auth.py`` has the scheme); without it a node refuses them. ``status`` and
``plan`` on a node with API keys need a key (``--api-key`` or RINGD_API_KEY) or
the secret.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from .auth import sign
from .config import DEFAULT_SECRET_FILE, ConfigError, read_secret_file

DEFAULT_NODE = "127.0.0.1:8100"
# A node answers status from memory; seconds of silence mean it is down or stuck.
HTTP_TIMEOUT_S = 5.0


class CtlError(Exception):
    pass


class Credentials:
    """What ringctl proves itself with: the cluster secret (read when first needed), an API key."""

    def __init__(self, secret_file: str | None, api_key: str | None):
        self.secret_file = secret_file
        self.api_key = api_key
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
        """The name of the node at ``node`` (signatures are for one node): its open /health says."""
        if node not in self._node_names:
            self._node_names[node] = str(fetch(node, "/health", allow_error=True).get("node", ""))
        return self._node_names[node]


def fetch(node: str, path: str, body: dict | None = None, creds: Credentials | None = None, sign_with_secret: bool = False, allow_error: bool = False) -> dict:
    url = f"http://{node}{path}"
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if creds is not None:
        secret = creds.secret(required=sign_with_secret)
        if secret is not None:
            method = "GET" if data is None else "POST"
            headers.update(sign(secret, method, path, creds.node_name(node), data or b"", time.time()))
        elif creds.api_key:
            headers["Authorization"] = f"Bearer {creds.api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
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
    except (OSError, ValueError) as e:
        raise CtlError(f"cannot read {url}: {e}; is ringd running there? (--node HOST:PORT)") from None


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


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
    for n in doc.get("nodes", []):
        layers = n.get("layers")
        health = "ready" if n.get("ready") else (n.get("error") or "not ready")
        table.add_row(
            n.get("node", "?"),
            n.get("addr", "-"),
            n.get("role", "-"),
            "-" if n.get("stage") is None else str(n["stage"]),
            f"[{layers[0]}, {layers[1]})" if layers else "-",
            _mib(n.get("budget")),
            _mib(n.get("parameter_bytes")),
            f"{_mib(n.get('kv_bytes'))} / {_mib(n.get('kv_capacity'))}",
            "-" if n.get("speed") is None else f"{n['speed']:.1f}",
            str(n.get("sessions", "-")),
            str(n.get("term") or "-"),
            health,
        )
    console.print(table)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringctl", description="Inspect and steer a ringd cluster.")
    parser.add_argument("--node", default=DEFAULT_NODE, help=f"any node's HTTP address, HOST:PORT (default {DEFAULT_NODE})")
    parser.add_argument(
        "--secret-file", default=os.environ.get("RINGD_SECRET_FILE"),
        help=f"the cluster secret, to sign control commands (default: RINGD_SECRET_FILE, else {DEFAULT_SECRET_FILE})",
    )  # fmt: skip
    parser.add_argument("--api-key", default=os.environ.get("RINGD_API_KEY"), help="an API key, for status on a node that requires keys (default: RINGD_API_KEY)")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="nodes, roles, layers, memory, health")
    status.add_argument("--json", action="store_true", help="print the raw status document")
    sub.add_parser("plan", help="the ring's order and layer ranges")
    leader = sub.add_parser("leader", help="pin the leader (set NODE) or let the election decide (auto)")
    leader_sub = leader.add_subparsers(dest="action", required=True)
    leader_sub.add_parser("set", help="pin NODE as leader").add_argument("target", metavar="NODE")
    leader_sub.add_parser("auto", help="unpin: priority and name decide")
    drain = sub.add_parser("drain", help="keep NODE out of the ring")
    drain.add_argument("target", metavar="NODE")
    drain.add_argument("--undo", action="store_true", help="let NODE back into the ring")
    args = parser.parse_args(argv)
    creds = Credentials(args.secret_file, args.api_key)
    try:
        if args.command == "status":
            doc = fetch(args.node, "/cluster/status", creds=creds)
            print(json.dumps(doc, indent=2)) if args.json else print_status(doc)
        elif args.command == "plan":
            print_plan(fetch(args.node, "/cluster/status", creds=creds))
        elif args.command == "leader":
            target = args.target if args.action == "set" else None
            answer = fetch(args.node, "/cluster/leader", {"node": target}, creds, sign_with_secret=True)
            print(f"pinned {target}" if target else "unpinned: the election decides", f"(pin epoch {answer['pin'][0]})")
        elif args.command == "drain":
            answer = fetch(args.node, "/cluster/drain", {"node": args.target, "undo": args.undo}, creds, sign_with_secret=True)
            print(f"drained: {', '.join(answer['drained']) or 'none'}")
    except CtlError as e:
        print(f"ringctl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
