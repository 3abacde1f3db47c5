"""--link: rings over links as Macs have them. For each ring size, the ring on loopback (its compute
and own work) kept while a ring over each profile's links runs (linkhosts.py), the two asked in
turn; then the tables, the theory (theory.py) beside each figure: one stream's ms per token, and
with --concurrency N streams' aggregate tok/s against the bound micro-batches in flight allow.
The client sits on the leader's host (a user on the leader Mac): its requests cross no link,
only the ring's steps do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from devkit.bench.linkhosts import (
    DTYPE_BYTES,
    LINK_ROUND_TRIPS,
    emulator_one_way_s,
    in_netns,
    link_profile,
    link_round_trips,
    ring_hops,
    settle,
    start_link_ring,
)
from devkit.bench.measure import processes_cpu_s
from devkit.bench.rings import ring_concurrent, ring_decode, start_ring, stop_ring, stream_prompts
from devkit.bench.theory import one_stream_theory_s, streams_bound_tok_s, unhidden_tok_s


def link_arguments(parser, args) -> None:
    """Refuse what ``--link`` cannot do, before any model or ring: no root, an unknown profile,
    another of the bench's measurements asked at once."""
    from devkit.netns import netns_available

    if sys.platform.startswith("linux") and os.geteuid() != 0:
        parser.error("--link runs each node on a host of its own, a network namespace, which only root may make: sudo -E env PATH=$PATH uv run tools/bench --link ...")
    missing = netns_available() or (None if Path("/dev/net/tun").exists() else "the link emulator needs TUN devices and /dev/net/tun is missing (modprobe tun)")
    if missing:
        parser.error(f"--link: {missing}")
    for name in args.link.split(","):
        try:
            link_profile(name)
        except ValueError as e:
            parser.error(f"--link: {e}, or none (the emulator with a link of no latency: its own cost)")
    # --pin-cores too: it pins ``ringd local``'s nodes, not the namespaces' daemons nor the emulator.
    others = [flag for flag, on in (("--replicas", args.replicas != 1), ("--tls", args.tls), ("--rate", args.rate), ("--embeddings", args.embeddings),
              ("--prefill-pause", args.prefill_pause), ("--json-schema", args.json_schema), ("--draft-model", args.draft_model),
              ("--mlx-pipeline", args.mlx_pipeline), ("--baseline", args.baseline),
              ("--pin-cores", args.pin_cores)) if on]  # fmt: skip
    if others:
        parser.error(f"--link measures plain rings over links (one stream, and --concurrency streams); drop {', '.join(others)}")


def links(args, model_path: str, reference_path: str, tok, prompt: list[int], no_eos: list[int]) -> int:
    """``--link``: for each ring size, the ring on loopback kept while a ring over each profile's
    links runs, the two asked in turn; then the tables, theory beside each figure."""
    # A SIGTERM ends the bench through its finally and with blocks: the rings stopped, the namespaces deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    profiles = [link_profile(name) for name in args.link.split(",")]
    sizes = [int(n) for n in args.nodes.split(",")]
    levels = [int(n) for n in args.concurrency.split(",")] if args.concurrency else []
    # A decode row's hidden state, as a hop carries it (the frame's header and descriptors aside).
    config = json.loads((Path(reference_path) / "config.json").read_text())
    row_bytes = config["hidden_size"] * DTYPE_BYTES.get(config.get("torch_dtype"), 4)
    bridge_s, emulated_s = emulator_one_way_s(row_bytes)
    print(f"one way, {row_bytes} bytes, median: plain bridge {1e6 * bridge_s:.0f} us, through the emulator (a link of no latency) "
          f"{1e6 * emulated_s:.0f} us: the emulator adds {1e6 * (emulated_s - bridge_s):.0f} us per crossing (idle machine)", flush=True)
    one: dict[tuple[str, int], dict] = {}  # (profile, nodes) -> the one-stream figures
    many: dict[tuple[str, int, int], dict] = {}  # (profile, nodes, streams) -> the aggregate figures
    for nodes in sizes:
        loopback = start_ring(model_path, nodes)
        try:
            ring_decode(loopback[1], prompt, 8, no_eos)  # warm-up: first-use allocations on every stage
            for p in profiles:
                one[(p.name, nodes)] = over_links(args, p, nodes, loopback, model_path, row_bytes, tok, prompt, no_eos, levels, many)
        finally:
            stop_ring(loopback[0])
    print()
    one_stream_table(args, row_bytes, one)
    if levels:
        print()
        streams_table(one, many)
    return 0


def over_links(args, p, nodes: int, loopback: tuple, model_path: str, row_bytes: int, tok, prompt: list[int], no_eos: list[int], levels: list[int], many: dict) -> dict:
    """A ring of ``nodes`` over links of profile ``p``, asked in turn with ``loopback`` for
    --repeats runs: one stream's figures (returned), and each level's streams' (into ``many``)."""
    import tempfile

    from devkit.netns import NetnsHosts

    with NetnsHosts(nodes, links=[p] * nodes) as net, tempfile.TemporaryDirectory(prefix="ringd-bench-link-") as tmp:
        rtts = link_round_trips(net, 0, 1, row_bytes) if nodes > 1 else [0.0]
        procs, url = start_link_ring(net, model_path, Path(tmp))
        with in_netns(net.hosts[0].name):
            settle(url, prompt, no_eos)
        emulator = [int(pid) for pid in subprocess.run(["ip", "netns", "pids", net.bridge_ns], capture_output=True, text=True, check=True).stdout.split()]
        ring = (net.hosts[0].name, url, [proc.pid for proc in procs], emulator)
        with in_netns(net.hosts[0].name):
            hops = ring_hops(url)
        f = {"rtt": rtts, "hops": hops, "loopback": [], "link": [], "cpu_loopback": [], "cpu_link": [], "cpu_emulator": [], "gaps_loopback": [], "gaps_link": []}
        for r in range(args.repeats):
            timed_in_turn(f, loopback, ring, args.tokens, lambda url, side: 1 / ring_decode(url, prompt, args.tokens, no_eos, gaps=f[f"gaps_{side}"]))
            for streams in levels:
                ps = stream_prompts(tok, streams, r)
                g = many.setdefault((p.name, nodes, streams), {"loopback": [], "link": [], "cpu_loopback": [], "cpu_link": [], "cpu_emulator": []})
                timed_in_turn(g, loopback, ring, streams * args.tokens, lambda url, _: ring_concurrent(url, ps, args.tokens, no_eos))
            print(
                f"{p.name}, {nodes} node(s), run {r + 1}/{args.repeats}: one stream {1000 * f['loopback'][-1]:.2f} ms/token on loopback, "
                f"{1000 * f['link'][-1]:.2f} over links" + "".join(f"; x{s} {many[(p.name, nodes, s)]['link'][-1]:.0f} tok/s" for s in levels),
                flush=True,
            )  # fmt: skip
    return f


def timed_in_turn(figures: dict, loopback: tuple, ring: tuple, tokens: int, ask) -> None:
    """``ask(url, side)`` of the loopback ring, then of the ring over links from inside its leader's host;
    each figure, and CPU seconds per token of each ring's processes and of the emulator, into ``figures``."""
    host, url, ring_pids, emulator = ring
    before = processes_cpu_s([loopback[0].pid])
    figures["loopback"].append(ask(loopback[1], "loopback"))
    figures["cpu_loopback"].append((processes_cpu_s([loopback[0].pid]) - before) / tokens)
    before, before_emulator = processes_cpu_s(ring_pids), processes_cpu_s(emulator)
    with in_netns(host):
        figures["link"].append(ask(url, "link"))
    figures["cpu_link"].append((processes_cpu_s(ring_pids) - before) / tokens)
    figures["cpu_emulator"].append((processes_cpu_s(emulator) - before_emulator) / tokens)


def one_stream_table(args, row_bytes: int, one: dict) -> None:
    """One stream's ms per token, measured beside the theory, by profile and ring size."""
    from statistics import mean, median

    print(f"links as Macs have them: {args.tokens} tokens a stream, greedy, {args.repeats} interleaved runs (medians); the client on the leader's host; "
          f"{os.cpu_count()} core(s), the emulator's process among them")
    print(f"one way: half a TCP round trip of {row_bytes} bytes (a decode row) between two of the hosts, {LINK_ROUND_TRIPS} of them, emulator and losses included")
    print("one stream, ms per token: theory = loopback + hops x one way, as a mean (what tok/s sees: each run's time per token, the median of the runs; "
          "one way's mean) and as a median (each token's gap, the median over the runs' tokens; one way's median: a token no other work delayed); "
          "CPU ms per token of all the ring's processes (user+system), the emulator's apart")  # fmt: skip
    print(f"{'profile':<12}{'nodes':>6}{'hops':>5}{'one way':>16}{'(profile)':>10}{'loopback':>14}{'theory':>14}{'links':>14}{'ratio':>12}"
          f"{'CPU loop':>10}{'CPU links':>10}{'emulator':>9}")
    for (name, nodes), f in one.items():
        way, way_med = mean(f["rtt"]) / 2, median(f["rtt"]) / 2
        lo, link = median(f["loopback"]), median(f["link"])
        lo_med, link_med = median(f["gaps_loopback"]), median(f["gaps_link"])
        theory, theory_med = one_stream_theory_s(lo, f["hops"], way), one_stream_theory_s(lo_med, f["hops"], way_med)
        print(
            f"{name:<12}{nodes:>6}{f['hops']:>5}{1e6 * way:>8.0f} ({1e6 * way_med:>4.0f})us{1e6 * link_profile(name).latency_s:>8.0f}us"
            f"{1000 * lo:>7.2f} ({1000 * lo_med:>5.2f}){1000 * theory:>7.2f} ({1000 * theory_med:>5.2f}){1000 * link:>7.2f} ({1000 * link_med:>5.2f})"
            f"{link / theory:>6.2f} ({link_med / theory_med:.2f})"
            f"{1000 * median(f['cpu_loopback']):>8.2f}ms{1000 * median(f['cpu_link']):>8.2f}ms{1000 * median(f['cpu_emulator']):>7.2f}ms"
        )  # fmt: skip
    print("ratio: measured over links / theory (above 1: the ring pays more than compute plus the links)")


def streams_table(one: dict, many: dict) -> None:
    """N streams' aggregate tok/s over links against the bound and the unhidden rate."""
    from statistics import mean, median

    print("N streams, aggregate tok/s (prefill included): bound = N / max(loopback time per token, one stream's loopback time + hops x one way),")
    print("the links hidden by micro-batches in flight as far as compute allows; unhidden = N / (loopback time per token + hops x one way)")
    print(f"{'profile':<12}{'nodes':>6}{'streams':>8}{'loopback':>10}{'bound':>8}{'unhidden':>9}{'links':>8}{'/bound':>8}{'CPU loop':>10}{'CPU links':>10}{'emulator':>9}")
    for (name, nodes, streams), g in many.items():
        f = one[(name, nodes)]
        one_way, lo = mean(f["rtt"]) / 2, median(g["loopback"])
        bound = streams_bound_tok_s(streams, lo, median(f["loopback"]), f["hops"], one_way)
        link = median(g["link"])
        print(
            f"{name:<12}{nodes:>6}{'x' + str(streams):>8}{lo:>10.1f}{bound:>8.1f}{unhidden_tok_s(streams, lo, f['hops'], one_way):>9.1f}{link:>8.1f}{link / bound:>8.2f}"
            f"{1000 * median(g['cpu_loopback']):>8.2f}ms{1000 * median(g['cpu_link']):>8.2f}ms{1000 * median(g['cpu_emulator']):>7.2f}ms"
        )  # fmt: skip
