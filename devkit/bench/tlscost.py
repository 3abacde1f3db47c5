"""--tls: the cost of TLS on a streamed token. Each ring beside one with ``--tls auto``, asked in
turn through a follower (every token crosses two TLS connections): wall ms per token, CPU ms per
token of the ring's event loops, of all its threads, and of the client's reading thread."""

from __future__ import annotations

import time

from devkit.bench.measure import cpu_seconds
from devkit.bench.rings import follower_url, ring_decode


def tls_cost(args, prompt: list[int], no_eos: list[int], rings: dict, secured: dict) -> None:
    """Wall and CPU ms per streamed token through a follower, TLS against plain, interleaved."""
    from statistics import median

    for nodes in rings:
        if nodes < 2:
            print(f"{nodes} node(s): no follower to stream through; skipped")
            continue
        figures: dict[str, dict[str, list[float]]] = {}
        for r in range(args.repeats):
            for name, (proc, url) in (("plain", rings[nodes]), ("TLS", secured[nodes])):
                via = follower_url(url)
                (loops_before, rest_before), client_before = cpu_seconds(proc.pid), time.thread_time()
                tps = ring_decode(via, prompt, args.tokens, no_eos)
                (loops, rest), client_cpu = cpu_seconds(proc.pid), time.thread_time() - client_before
                f = figures.setdefault(name, {"wall": [], "loops": [], "ring": [], "client": []})
                f["wall"].append(1000 / tps)
                # TLS's work (records sealed and opened) is on the event loops; compute is not.
                f["loops"].append(1000 * (loops - loops_before) / args.tokens)
                f["ring"].append(1000 * (loops - loops_before + rest - rest_before) / args.tokens)
                f["client"].append(1000 * client_cpu / args.tokens)
            print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v['wall'][-1]:.2f} ms/token" for k, v in figures.items()), flush=True)
        print()
        print(f"{nodes} node(s), streamed through a follower, {args.tokens} tokens, prompt {len(prompt)} tokens, {args.repeats} interleaved runs, medians")
        print("ms per token: wall; CPU of the ring's event loops, of all the ring's threads, of the client's reading thread")
        print(f"{'':<12}{'wall':>10}{'ring loops':>12}{'ring all':>12}{'client':>10}")
        med = {k: {m: median(v) for m, v in f.items()} for k, f in figures.items()}
        for name in ("plain", "TLS"):
            m = med[name]
            print(f"{name:<12}{m['wall']:>10.3f}{m['loops']:>12.3f}{m['ring']:>12.3f}{m['client']:>10.3f}")
        d = {k: med["TLS"][k] - med["plain"][k] for k in ("wall", "loops", "ring", "client")}
        print(f"{'TLS - plain':<12}{d['wall']:>+10.3f}{d['loops']:>+12.3f}{d['ring']:>+12.3f}{d['client']:>+10.3f}")
