"""``ringctl``: look at a running ring from any node's HTTP port.

``ringctl status`` prints the leader's view: every node, its role, stage and
layers, parameter and KV memory, live sessions and readiness (``--json`` for
the raw document). It talks HTTP to one node (``--node HOST:PORT``, default
the local daemon) and never to the ring port.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

DEFAULT_NODE = "127.0.0.1:8100"
# A node answers status from memory; seconds of silence mean it is down or stuck.
HTTP_TIMEOUT_S = 5.0


class CtlError(Exception):
    pass


def fetch(node: str, path: str) -> dict:
    url = f"http://{node}{path}"
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise CtlError(f"{url} answered {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    except (OSError, ValueError) as e:
        raise CtlError(f"cannot read {url}: {e}; is ringd running there? (--node HOST:PORT)") from None


def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:,.1f}"


def print_status(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = f"ring term {doc['plan']['term']}" if doc.get("plan") else "no plan yet"
    table = Table(title=f"{title} — leader {doc.get('leader') or '?'}")
    for col in ("node", "address", "role", "stage", "layers", "params MiB", "KV MiB", "sessions", "health"):
        table.add_column(col, justify="right" if col in ("stage", "params MiB", "KV MiB", "sessions") else "left")
    for n in doc.get("nodes", []):
        layers = n.get("layers")
        health = "ready" if n.get("ready") else (n.get("error") or "not ready")
        table.add_row(
            n.get("node", "?"),
            n.get("addr", "-"),
            n.get("role", "-"),
            "-" if n.get("stage") is None else str(n["stage"]),
            f"[{layers[0]}, {layers[1]})" if layers else "-",
            _mib(n.get("parameter_bytes")),
            _mib(n.get("kv_bytes")),
            str(n.get("sessions", "-")),
            health,
        )
    console.print(table)
    if not doc.get("ready"):
        console.print(f"[bold red]not serving:[/] {doc.get('reason') or 'unknown'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringctl", description="Inspect a ringd cluster.")
    parser.add_argument("--node", default=DEFAULT_NODE, help=f"any node's HTTP address, HOST:PORT (default {DEFAULT_NODE})")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="nodes, roles, layers, memory, health")
    status.add_argument("--json", action="store_true", help="print the raw status document")
    args = parser.parse_args(argv)
    try:
        doc = fetch(args.node, "/cluster/status")
    except CtlError as e:
        print(f"ringctl: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_status(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
