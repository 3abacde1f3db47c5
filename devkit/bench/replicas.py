"""--replicas R (with --concurrency): a ring of N against the same N nodes as R rings of N/R, and
mlx-lm's BatchGenerator, interleaved: aggregate tokens/s, CPU ms per token, and the requests each
replica took (``/api/ps``'s ``served``)."""

from __future__ import annotations

import json
import os
import time

from devkit.bench.measure import cpu_seconds, own_cpu_seconds
from devkit.bench.reference import batch_generator
from devkit.bench.rings import ring_concurrent, stream_prompts, urlopen

# How long the replicas of a ``--replicas`` ring may take to load and re-plan, each over its share
# of the nodes, after the configured model first served over all of them (a tiny model: seconds).
REPLICAS_READY_TIMEOUT_S = 300
REPLICAS_POLL_S = 0.5


def replica_rows(url: str) -> list[dict]:
    """The leader's instances (``/api/ps``, ringd's fields of each row), by their first node."""
    with urlopen(url + "/api/ps", timeout=10) as r:
        rows = [m["ringd"] for m in json.loads(r.read())["models"]]
    return sorted(rows, key=lambda row: [s[0] for s in row["stages"]])


def wait_for_replicas(url: str, replicas: int) -> list[dict]:
    """The rows of ``replicas`` instances once all are ready over disjoint sets of nodes: until
    then the configured model may still be planned over every node, or a replica loading."""
    deadline = time.monotonic() + REPLICAS_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        rows = replica_rows(url)
        node_sets = [{s[0] for s in row["stages"]} for row in rows]
        if len(rows) == replicas and all(row["ready"] for row in rows) and sum(map(len, node_sets)) == len(set().union(*node_sets)):
            return rows
        time.sleep(REPLICAS_POLL_S)
    raise SystemExit(f"bench: {url} did not list {replicas} ready replicas on disjoint nodes within {REPLICAS_READY_TIMEOUT_S} s; /api/ps: {replica_rows(url)}")


def served_counts(url: str) -> dict[str, int]:
    """Requests routed to each replica so far (``served`` of each ``/api/ps`` row), by instance."""
    return {row["instance"]: row["served"] for row in replica_rows(url)}


def replicas_against_one(args, model, tok, rings: dict[int, tuple], replicated: dict[int, tuple], no_eos: list[int]) -> None:
    """N streams at once on one ring of every node against the same nodes as ``--replicas`` rings
    (each over its share), and mlx-lm's BatchGenerator, interleaved: aggregate tokens/s, CPU ms per
    token of each ring's processes, and how the replicated ring's leader spread the streams."""
    from statistics import median

    levels = [int(n) for n in args.concurrency.split(",")]
    R = args.replicas
    runs: dict[tuple[str, int], list[float]] = {}
    used: dict[tuple[str, int], list[float]] = {}  # CPU ms per token: all the ring's processes, or this process for mlx-lm
    served: dict[tuple[int, int], dict[str, int]] = {}  # (nodes, streams): requests each replica took, all runs
    for r in range(args.repeats):
        for n in levels:
            ps = stream_prompts(tok, n, r)
            before = own_cpu_seconds()
            runs.setdefault(("mlx-lm BatchGenerator", n), []).append(batch_generator(model, ps, args.tokens))
            used.setdefault(("mlx-lm BatchGenerator", n), []).append(1000 * (own_cpu_seconds() - before) / (n * args.tokens))
            for nodes in rings:
                for name, (proc, url), spread in ((f"1 ring of {nodes}", rings[nodes], False), (f"{R} rings of {nodes // R}", replicated[nodes], True)):
                    counted = served_counts(url) if spread else {}
                    before = sum(cpu_seconds(proc.pid))
                    runs.setdefault((name, n), []).append(ring_concurrent(url, ps, args.tokens, no_eos))
                    used.setdefault((name, n), []).append(1000 * (sum(cpu_seconds(proc.pid)) - before) / (n * args.tokens))
                    if counted:
                        total = served.setdefault((nodes, n), dict.fromkeys(counted, 0))
                        for instance, count in served_counts(url).items():
                            total[instance] = total.get(instance, 0) + count - counted.get(instance, 0)
        print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{k[0]} x{k[1]} {v[-1]:.1f} tok/s" for k, v in runs.items()), flush=True)
    print()
    print(
        f"aggregate tokens/s of N streams, greedy, {args.tokens} tokens each, prefill included, {args.repeats} interleaved runs (median); "
        "CPU ms per generated token: every thread of every process of the ring (user+system), of this process for mlx-lm"
    )  # fmt: skip
    for nodes in rings:
        one, many = f"1 ring of {nodes}", f"{R} rings of {nodes // R}"
        print(f"{'streams':<9}{'mlx-lm':>9}{one:>13}{many:>13}{'ratio':>7}{'CPU mlx-lm':>12}{'CPU ' + one:>17}{'CPU ' + many:>17}{'CPU ratio':>11}  requests per replica")
        for n in levels:
            tps = [median(runs[(k, n)]) for k in ("mlx-lm BatchGenerator", one, many)]
            cpu = [median(used[(k, n)]) for k in ("mlx-lm BatchGenerator", one, many)]
            spread = " + ".join(str(c) for c in served[(nodes, n)].values())
            print(
                f"{'x' + str(n):<9}{tps[0]:>9.1f}{tps[1]:>13.1f}{tps[2]:>13.1f}{tps[2] / tps[1]:>7.2f}"
                f"{cpu[0]:>12.2f}{cpu[1]:>17.2f}{cpu[2]:>17.2f}{cpu[2] / cpu[1]:>11.2f}  {spread}"
            )  # fmt: skip
    # Wall time on a machine with fewer cores than processes is bound by the cores, shared by both
    # layouts alike; CPU per token is not, and says which layout does less work for a token.
    print(f"ratio: {R} rings' tok/s (or CPU ms per token) over the one ring's; {os.cpu_count()} core(s) on this machine")
