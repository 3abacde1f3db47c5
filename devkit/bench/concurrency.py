"""--concurrency: aggregate tokens/s of N streams at once on each ring against mlx-lm's
BatchGenerator with the same N prompts, interleaved; CPU ms per token of each ring, its event
loops apart from its other threads."""

from __future__ import annotations

import os

from devkit.bench.measure import cpu_seconds
from devkit.bench.reference import batch_generator
from devkit.bench.rings import ring_concurrent, stream_prompts


def concurrency(args, model, tok, rings: dict[str, tuple], no_eos: list[int]) -> None:
    """Aggregate throughput of 1, 2, 4, ... streams: mlx-lm's BatchGenerator against each ring (by its
    name: this code's and the baseline's), interleaved."""
    from statistics import median

    levels = [int(n) for n in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list[float]] = {}
    used: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (ring, streams): CPU ms per token, loops and the rest
    for r in range(args.repeats):
        for n in levels:
            ps = stream_prompts(tok, n, r)
            runs.setdefault(("mlx-lm BatchGenerator", n), []).append(batch_generator(model, ps, args.tokens))
            for name, (proc, url) in rings.items():
                before = cpu_seconds(proc.pid)
                runs.setdefault((name, n), []).append(ring_concurrent(url, ps, args.tokens, no_eos))
                after = cpu_seconds(proc.pid)
                used.setdefault((name, n), []).append(tuple(1000 * (a - b) / (n * args.tokens) for a, b in zip(after, before)))
        print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{k[0]} x{k[1]} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    print()
    print(f"aggregate tokens/s of N streams, greedy, {args.tokens} tokens each, prefill included, {args.repeats} interleaved runs (median)")
    names = list(dict.fromkeys(k[0] for k in runs))
    print(f"{'configuration':<32}" + "".join(f"{'x' + str(n):>10}" for n in levels) + f"{'x' + str(levels[-1]) + '/x' + str(levels[0]):>12}")
    for name in names:
        meds = [median(runs[(name, n)]) for n in levels]
        print(f"{name:<32}" + "".join(f"{m:>10.1f}" for m in meds) + f"{meds[-1] / meds[0]:>12.2f}")
    for name in names[1:]:
        print(f"{name} / BatchGenerator: " + ", ".join(f"x{n} {median(runs[(name, n)]) / median(runs[(names[0], n)]):.2f}" for n in levels))
    # Where the machine's time went: CPU seconds per token of the ring's processes, their event
    # loops apart (links, HTTP, the leader's schedule) from their other threads (the compute
    # thread and MLX's). A ring that uses every core makes at most cores / (CPU per token).
    cores = os.cpu_count() or 1
    for name in rings:
        one = median(runs[(name, levels[0])])
        cpu = {n: (median(c[0] for c in used[(name, n)]), median(c[1] for c in used[(name, n)])) for n in levels}
        print(
            f"{name}, CPU ms per token (event loops + the rest): "
            + ", ".join(f"x{n} {loops:.2f} + {rest:.2f}" for n, (loops, rest) in cpu.items())
            + f"; all {cores} cores busy would make at most "
            + ", ".join(f"x{n} {1000 * cores / sum(cpu[n]) / one:.2f}x" for n in levels)
            + f" the x{levels[0]} rate"
        )  # fmt: skip
