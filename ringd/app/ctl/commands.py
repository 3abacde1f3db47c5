"""ringctl's command line: the flags, which node it talks to and as whom (``--node``, the
secret, the pin store), and each command handed to the module that does it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ringd.app import service
from ringd.cluster.sharing import MAX_REPLICAS
from ringd.node.config import DEFAULT_SECRET_FILE
from ringd.app.ctl.client import DEFAULT_CLUSTER, Credentials, Trust, fetch
from ringd.app.ctl.errors import CtlError
from ringd.app.ctl.install import LOG_LINES, install, logs, uninstall
from ringd.app.ctl.pins import DEFAULT_KNOWN_NODES, KnownNodes
from ringd.ring.statusdoc import ClusterStatus
from ringd.app.ctl.render import instances_of, print_instances, print_models, print_plan, print_status
from ringd.app.ctl.top import MIN_TOP_INTERVAL_S, TOP_INTERVAL_S, top
from ringd.base.names import DEFAULT_HTTP_PORT, check_name
from ringd.security.tls import cluster_ca_pem

DEFAULT_NODE = f"127.0.0.1:{DEFAULT_HTTP_PORT}"
# `ringctl load` waits while the leader places the model and the nodes read their layers: a
# large model from a Mac's SSD takes a minute or two (the leader's own bound is pool.LOAD_TIMEOUT_S).
LOAD_TIMEOUT_S = 600.0


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


def build_parser() -> argparse.ArgumentParser:
    """Every flag and command of ringctl."""
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
    _add_cluster_commands(sub)
    _add_service_commands(sub)
    return parser


def _add_cluster_commands(sub) -> None:
    """The commands that ask a node or steer the cluster over its HTTP API."""
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
    unload = sub.add_parser("unload", help="unload MODEL (every instance of it): now if idle, else once its requests end")
    unload.add_argument("model", metavar="MODEL")
    drain = sub.add_parser("drain", help="keep NODE out of the ring")
    drain.add_argument("target", metavar="NODE")
    drain.add_argument("--undo", action="store_true", help="let NODE back into the ring")


def _add_service_commands(sub) -> None:
    """install, uninstall, logs: ringd serve as a service of this machine."""
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
            print_instances(instances_of(ClusterStatus.parse(fetch(args.node, "/cluster/status", creds=creds))))
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

