"""``ringctl top``: the status, redrawn live in the terminal's alternate screen, as top(1)."""

from __future__ import annotations

import time

from ringd.app.ctl.client import Credentials, fetch
from ringd.app.ctl.errors import CtlError
from ringd.app.ctl.render import count, drained_nodes, health_of, layer_range, mib, progress_grid, stats_line
from ringd.ring.statusdoc import ClusterStatus

# `top` redraws once a second by default: live enough for a person watching.
TOP_INTERVAL_S = 1.0
# Each poll asks every node over the ring for its status; faster than this shows
# nothing a person can read and only loads the cluster.
MIN_TOP_INTERVAL_S = 0.1


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def top_view(node: str, doc: dict | None, error: str | None, seen_at: float | None, polls: int, interval: float):
    """What `ringctl top` draws: the header, the nodes, live figures. ``doc`` is the last answer (kept when one fails)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list = []
    header = Text()
    doc = ClusterStatus.parse(doc) if doc is not None else None
    if doc is not None:
        header.append(f"leader {doc.leader or '?'}", style="bold")
        header.append(" · ")
        if doc.ready:
            header.append("ready", style="bold green")
        else:
            header.append(f"not ready: {doc.reason or 'unknown'}", style="bold red")
        header.append(f" · term {doc.plan.get('term')}" if doc.plan is not None else " · no plan yet")
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
    drained = drained_nodes(doc)
    for n in doc.nodes:
        health = health_of(n, drained)
        table.add_row(
            n.node,
            n.role or "-",
            count(n.stage),
            layer_range(n),
            mib(n.parameter_bytes),
            f"{mib(n.kv_bytes)} / {mib(n.kv_capacity)}",
            mib(n.budget),
            count(n.sessions),
            count(n.active_requests),
            count(n.queued_requests),
            str(n.term or "-"),
            Text(health, style="green" if health == "ready" else "yellow" if health == "drained" else "red"),
        )
    parts.append(table)
    stats = stats_line(doc)
    if stats:
        parts.append(Text(stats))
    loading = progress_grid(doc)
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
