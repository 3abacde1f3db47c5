"""What ringctl prints from the documents a node answers: the status table (with the leader's
figures and any download or load under way), the plan, the model list, the instances. Pure
functions of a document: no requests here."""

from __future__ import annotations

from ringd.models import progress
from ringd.ring.statusdoc import ClusterStatus, NodeStatus


def number(v) -> float | None:
    """A figure from a status document, or None if it is absent or not a number (fields come and go)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def mib(n) -> str:
    n = number(n)
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
            str(m.get("quant") or "-"), str(m.get("architecture") or "-"), str(m.get("layers") or "-"), mib(m.get("size")), fits,
        )  # fmt: skip
    console.print(table)
    for line in notes:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if doc.get("truncated"):
        console.print("(the list stopped short: more models are on disk than one listing reads)", markup=False)


def layer_range(n: NodeStatus) -> str:
    return f"[{n.layers[0]}, {n.layers[1]})" if n.layers is not None and len(n.layers) == 2 else "-"


def drained_nodes(doc: ClusterStatus) -> set[str]:
    # Every node keeps the leader's drain list; the union still holds when the leader is silent.
    return {x for n in doc.nodes for x in n.drained if isinstance(x, str)}


def health_of(n: NodeStatus, drained: set[str]) -> str:
    # A drained node may well be ready (it forwards the API), but it holds no layers: say that.
    if n.node in drained:
        return "drained"
    return "ready" if n.ready else n.error or "not ready"


def speed(n: NodeStatus) -> str:
    return "-" if n.speed is None else f"{n.speed:.1f}"


def count(v: int | None) -> str:
    return "-" if v is None else str(v)


def print_status(raw: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    doc = ClusterStatus.parse(raw)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped or captured: keep whole rows instead of rich's 80 columns
    title = f"ring term {doc.plan.get('term')}" if doc.plan else "no plan yet"
    table = Table(title=f"{title} — leader {doc.leader or '?'}")
    numeric = ("stage", "budget MiB", "params MiB", "KV MiB", "speed", "sessions", "term")
    columns = ("node", "address", "role", "stage", "layers", "budget MiB", "params MiB", "KV MiB", "speed", "sessions", "term", "health")
    for col in columns:
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col in ("node", "address"))
    drained = drained_nodes(doc)
    for n in doc.nodes:
        table.add_row(
            n.node,
            n.addr or "-",
            n.role or "-",
            count(n.stage),
            layer_range(n),
            mib(n.budget),
            mib(n.parameter_bytes),
            f"{mib(n.kv_bytes)} / {mib(n.kv_capacity)}",
            speed(n),
            count(n.sessions),
            str(n.term or "-"),
            health_of(n, drained),
        )
    console.print(table)
    # What top shows live, once: the leader's figures and any download or load under way.
    stats = stats_line(doc)
    if stats:
        console.print(stats, markup=False)
    loading = progress_grid(doc)
    if loading is not None:
        console.print(loading)
    # Models besides the configured one (loaded on demand, replicas), each with its state: loading ones say why.
    rows = instances_of(doc)
    if len(rows) > 1:
        console.print("models:", *instance_lines(rows), sep="\n", markup=False, highlight=False)
    if not doc.ready:
        console.print(f"[bold red]not serving:[/] {doc.reason or 'unknown'}")


def print_plan(raw: dict) -> None:
    doc = ClusterStatus.parse(raw)
    plan = doc.plan
    if not plan:
        print(f"no plan yet: {doc.reason or 'waiting'}")
        return
    print(f"plan {plan['term']} by {plan['leader']}, model {plan['model']}, {plan['num_layers']} layers")
    for i, (node, addr, start, end, *group) in enumerate(plan["stages"]):
        members = [(node, addr)] + [tuple(m) for m in (group[0] if group else [])]
        if len(members) > 1:
            first = doc.status_of(node)
            on = f", all-reduces on {first.engine}" if first is not None and first.engine else ""
            print(f"  stage {i}: a tensor-parallel group of {len(members)}, each member a 1/{len(members)} slice of every layer in [{start}, {end}){on}")
        for rank, (member, where) in enumerate(members):
            n = doc.status_of(member) or NodeStatus(member)
            label = f"stage {i}:" if len(members) == 1 else f"  rank {rank}:"
            print(
                f"  {label} {member:<16} {where:<22} layers [{start}, {end})  ({end - start})  "
                f"budget {mib(n.budget)} MiB, weights {mib(n.parameter_bytes)} MiB, "
                f"KV {mib(n.kv_bytes)} of {mib(n.kv_capacity)} MiB, speed {speed(n)}{' GFLOP/s' if n.speed is not None else ''}"
            )
    for line in layout_lines(next((n.layout for n in doc.nodes if n.leading and n.layout), None)):
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
    if layout.get("groups"):  # tensor_parallel auto
        lines.append(f"tensor_parallel auto: {layout['groups']}")
    return lines


def instances_of(doc: ClusterStatus) -> list[dict]:
    """The leader's instances, from a cluster status document."""
    return next((n.instances for n in doc.nodes if n.leading), [])


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


def stats_line(doc: ClusterStatus) -> str | None:
    leader = doc.status_of(doc.leader)
    stats = leader.stats if leader else None
    if not isinstance(stats, dict):
        return None
    parts = [f"{label} {fmt.format(number(stats[key]))}" for key, label, fmt in _STATS if number(stats.get(key)) is not None]
    return " · ".join(parts) or None


def progress_grid(doc: ClusterStatus):
    """One line per load under way: each node's of the configured model's layers, and of any
    other instance's (a model loaded on demand, a replica; named beside the node), or None."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    loads = [(n.node, n.progress) for n in doc.nodes]
    loads += [(f"{n.node} ({s.get('instance')})", s.get("progress")) for n in doc.nodes for s in n.instance_stages if isinstance(s, dict)]
    for who, p in loads:
        if not isinstance(p, dict):
            continue
        done, total, rate = number(p.get("bytes")), number(p.get("total_bytes")), number(p.get("rate_bytes_s"))
        figures = [f"{done / total:.0%}" if done is not None and total else "", f"{mib(done)} / {mib(total)} MiB"]
        if rate is not None:
            figures.append(f"{mib(rate)} MiB/s")
        if isinstance(p.get("file"), str):
            figures.append(p["file"])
        # No total yet: rich draws an indeterminate bar.
        bar = ProgressBar(total=total if total else None, completed=done or 0, width=24)
        grid.add_row(who, progress.verb(p.get("phase")), bar, "  ".join(f for f in figures if f))
    return grid if grid.row_count else None
