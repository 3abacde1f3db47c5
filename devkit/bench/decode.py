"""The bench's default mode: decode tokens/s of single-process mlx-lm against each ring, interleaved
(mlx-lm, ring 2, ring 3, mlx-lm, ...); CPU ms and context switches per token; the stages' compute
apart from the rest; and beside them what the flags add: a baseline checkout's rings, a draft
model (mlx-lm's speculative decoding and each ring's), a JSON schema's mask, mlx-lm's pipeline.
Then the CPU table: what one extra stage costs, against MLX's own cost of an extra evaluation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from devkit.bench.draft import draft_counts, single_process_speculative
from devkit.bench.measure import LOOP, OTHER, by_thread, cpu_seconds, own_cpu_seconds, session_pids, slope, switches
from devkit.bench.reference import MLX_PIPELINE_FAILURES, in_pieces, mlx_pipeline, single_process, with_index
from devkit.bench.rings import Started, decode_and_compute, ring_decode

MLX_LM = "mlx-lm, 1 process"
MLX_LM_DRAFT = "mlx-lm, 1 process, draft"
# How many proposals mlx-lm's speculative decoding makes a step, as a ring's leader does.
NUM_DRAFT_TOKENS = 3
# Issue 31's target for what a ring's extra stage costs in CPU per token: MLX's own extra
# evaluation (~0.15 ms in one process on the tiny model) plus at most 0.15 ms of the ring's work.
CPU_PER_STAGE_TARGET_MS = 0.30
# The thread switches one extra stage may add to a token's trip (every thread of every
# ring process, prefill included): a frame in, the evaluation, a frame out, and a little slack.
SWITCHES_PER_STAGE_TARGET = 8


@dataclass
class Figures:
    """Every run's figures, by configuration (``runs``' order is the table's)."""

    runs: dict[str, list[float]]  # tokens/s
    piped: list[int]  # ring sizes mlx-lm's pipeline runs at too
    schema: dict | None
    computed: dict = field(default_factory=dict)  # ms per token the stages spent computing, per ring size
    # CPU ms per token, all threads (prefill included): what a shared machine's load does not blur.
    cpu: dict[str, list[float]] = field(default_factory=dict)
    # CPU ms per token of mlx-lm in this process, each token's layers evaluated in as many pieces as a ring has stages.
    pieces: dict[int, list[float]] = field(default_factory=dict)
    # A ring's CPU ms and context switches per token by thread (measure.by_thread's parts), each run.
    split: dict[str, list[dict[str, tuple[float, float]]]] = field(default_factory=dict)
    wakes: dict[str, list[float]] = field(default_factory=dict)  # context switches per token, every thread (prefill included)
    kept: dict[str, list[float]] = field(default_factory=dict)  # proposals kept, proposals made (tokens, for mlx-lm)


def json_schema(tokens: int) -> dict:
    """A schema whose answers are longer than ``tokens`` tokens (an item and a comma each take one at least)."""
    return {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": tokens}}}


def configurations(args, started: Started, sizes: list[int], draft: bool, prompt: list[int], no_eos: list[int]) -> Figures:
    """The configurations this run measures, in the table's order, with no figures yet."""
    runs: dict[str, list[float]] = {MLX_LM: []}
    runs.update({f"ringd local, {n} node(s)": [] for n in sizes})
    runs.update({f"baseline, {n} node(s)": [] for n in started.baselines})
    piped = [n for n in sizes if n > 1] if args.mlx_pipeline else []
    runs.update({f"mlx-lm pipeline, {n} ranks": [] for n in piped})
    fig = Figures(runs, piped, json_schema(args.tokens) if args.json_schema else None)
    if draft:
        runs[MLX_LM_DRAFT] = []
        fig.kept[MLX_LM_DRAFT] = [0, 0]
        for n in sizes:
            for name in [f"ringd local, {n} node(s), draft"] + ([f"baseline, {n} node(s), draft"] if n in started.drafted_baselines else []):
                runs[name] = []
                fig.kept[name] = [0.0, 0.0]
    if fig.schema:
        order = [MLX_LM] + [name for n in sizes for name in (f"ringd local, {n} node(s)", f"ringd local, {n} node(s), json_schema")]
        fig.runs = {k: [] for k in order + [f"baseline, {n} node(s)" for n in started.baselines]}
        for n in sizes:
            ring_decode(started.rings[n][1], prompt, 8, no_eos, fig.schema)  # warm-up: the grammar tokenizer is built once per node
    return fig


def decode(args, model, draft_model, started: Started, sizes: list[int], prompt: list[int], no_eos: list[int], reference_path: str) -> Figures:
    """--repeats interleaved runs of every configuration; each run's figures printed as it ends."""
    fig = configurations(args, started, sizes, draft_model is not None, prompt, no_eos)
    indexed = with_index(reference_path) if fig.piped else None
    for r in range(args.repeats):
        counts = {k: len(v) for k, v in fig.runs.items()}
        mlx_lm_run(args, fig, model, draft_model, sizes, prompt, indexed)
        for n in sizes:
            rings_run(args, fig, started, n, prompt, no_eos)
        print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in fig.runs.items() if len(v) > counts[k]), flush=True)
    return fig


def mlx_lm_run(args, fig: Figures, model, draft_model, sizes: list[int], prompt: list[int], indexed: str | None) -> None:
    """One run of mlx-lm: in this process (whole, in pieces, with the draft) and as its pipeline."""
    before, woken = own_cpu_seconds(), switches([os.getpid()])
    fig.runs[MLX_LM].append(single_process(model, prompt, args.tokens))
    fig.cpu.setdefault(MLX_LM, []).append(1000 * (own_cpu_seconds() - before) / args.tokens)
    fig.wakes.setdefault(MLX_LM, []).append((switches([os.getpid()]) - woken) / args.tokens)
    for n in sizes:
        fig.pieces.setdefault(n, []).append(in_pieces(model, prompt, args.tokens, n))
    if draft_model is not None:
        fig.runs[MLX_LM_DRAFT].append(single_process_speculative(model, draft_model, prompt, args.tokens, NUM_DRAFT_TOKENS, fig.kept[MLX_LM_DRAFT]))
    for n in fig.piped:
        tps = mlx_pipeline(indexed, n, len(prompt), args.tokens)
        if tps is not None:
            fig.runs[f"mlx-lm pipeline, {n} ranks"].append(tps)


def rings_run(args, fig: Figures, started: Started, n: int, prompt: list[int], no_eos: list[int]) -> None:
    """One run of every ring of ``n`` nodes: this code's and the baseline's, with the draft, with the schema."""
    for key, name, ring in [(n, f"ringd local, {n} node(s)", started.rings[n]), *([(("baseline", n), f"baseline, {n} node(s)", started.baselines[n])] if n in started.baselines else [])]:
        before = by_thread(session_pids(ring[0].pid))
        tps, ms = decode_and_compute(ring[1], prompt, args.tokens, no_eos)
        after = by_thread(session_pids(ring[0].pid))
        parts = {
            part: (1000 * (cpu - before.get(part, (0.0, 0))[0]) / args.tokens, (woken - before.get(part, (0.0, 0))[1]) / args.tokens)
            for part, (cpu, woken) in after.items()
        }  # fmt: skip
        fig.wakes.setdefault(name, []).append(sum(w for _, w in parts.values()))
        fig.cpu.setdefault(name, []).append(sum(c for c, _ in parts.values()))
        fig.split.setdefault(name, []).append(parts)
        fig.runs[name].append(tps)
        fig.computed.setdefault(key, []).append(ms)
    for name, ring in [(f"ringd local, {n} node(s), draft", started.drafted.get(n)), (f"baseline, {n} node(s), draft", started.drafted_baselines.get(n))]:
        if ring is None:
            continue
        before, cpu_before = draft_counts(ring[1]), sum(cpu_seconds(ring[0].pid))
        fig.runs[name].append(ring_decode(ring[1], prompt, args.tokens, no_eos))
        fig.cpu.setdefault(name, []).append(1000 * (sum(cpu_seconds(ring[0].pid)) - cpu_before) / args.tokens)
        after = draft_counts(ring[1])
        fig.kept[name][0] += after[0] - before[0]
        fig.kept[name][1] += after[0] - before[0] + after[1] - before[1]
    if fig.schema:
        fig.runs[f"ringd local, {n} node(s), json_schema"].append(ring_decode(started.rings[n][1], prompt, args.tokens, no_eos, fig.schema))


def report(args, fig: Figures, sizes: list[int], prompt: list[int], baselines: dict) -> None:
    """The decode table, then what each flag added to it."""
    from statistics import median

    runs = fig.runs
    base = median(runs[MLX_LM])
    print()
    print(f"decode tokens/s, {'temperature ' + str(args.temperature) if args.temperature else 'greedy'}, {args.tokens} tokens, prompt {len(prompt)} tokens, {args.repeats} interleaved runs")
    print(f"{'configuration':<40}{'median':>10}{'best':>10}{'ratio':>10}")
    for name, values in runs.items():
        if values:
            print(f"{name:<40}{median(values):>10.2f}{max(values):>10.2f}{median(values) / base:>10.3f}")
    if fig.cpu:
        print("CPU ms per token, every thread of every process (prefill included), median: " + ", ".join(f"{k} {median(v):.2f}" for k, v in fig.cpu.items()))
        # On MLX's CPU backend most of these are its stream thread, woken for each batch of
        # operations: how many (and so the CPU above) moves with what else the cores do.
        print("context switches per token, every thread (prefill included), median: " + ", ".join(f"{k} {median(v):.1f}" for k, v in fig.wakes.items()))
    if fig.pieces:
        cpu_per_stage(sizes, fig.cpu, fig.pieces, baselines, fig.split, fig.wakes)
    for n in sizes if args.json_schema else ():
        plain, masked = median(runs[f"ringd local, {n} node(s)"]), median(runs[f"ringd local, {n} node(s), json_schema"])
        print(f"json_schema on {n} node(s): {1000 / masked - 1000 / plain:+.2f} ms per token ({masked / plain:.3f} of the speed without)")
    if len(sizes) > 1 and not fig.schema:
        per_stage(sizes, base, runs, fig.computed)
    for n in baselines:
        this, then = median(runs[f"ringd local, {n} node(s)"]), median(runs[f"baseline, {n} node(s)"])
        c_this, c_then = median(fig.computed[n]), median(fig.computed[("baseline", n)])
        print(
            f"{n} node(s): this code {1000 / this:.2f} ms per token (compute {c_this:.2f}, the rest {1000 / this - c_this:.2f}), "
            f"the baseline {1000 / then:.2f} (compute {c_then:.2f}, the rest {1000 / then - c_then:.2f}): {this / then:.3f}x its speed"
        )  # fmt: skip
    pipeline_lines(fig.piped, runs)
    for name, (accepted, made) in fig.kept.items():
        plain_name = name.removesuffix(", draft")
        what = "tokens that were a kept proposal" if name.startswith("mlx-lm") else "proposals kept"
        print(f"{name}: {median(runs[name]) / median(runs[plain_name]):.2f}x without the draft; {what}: {accepted / max(made, 1):.2f}")


def per_stage(sizes: list[int], base: float, runs: dict[str, list[float]], computed: dict) -> None:
    """What each stage adds to a token's time: the slope of ms per token over the ring's size
    (least squares), the same layers computed by every ring; the stages' compute apart."""
    from statistics import median

    xs, ys = sizes, [1000 / median(runs[f"ringd local, {n} node(s)"]) for n in sizes]
    print(f"ms per token: mlx-lm {1000 / base:.2f}; " + ", ".join(f"{n} node(s) {y:.2f}" for n, y in zip(xs, ys)) + f"; each extra stage {slope(xs, ys):.2f} ms")
    # Split: the stages' compute (a frame's parse, its graph built and evaluated, its output
    # viewed as bytes) and everything else (links, event loops, thread handoffs, the leader).
    cs = [median(computed[n]) for n in sizes]
    print(
        "of which the stages' compute: " + ", ".join(f"{n} node(s) {c:.2f}" for n, c in zip(xs, cs)) + f"; each extra stage {slope(xs, cs):.2f} ms"
        + "; the rest: " + ", ".join(f"{n} node(s) {y - c:.2f}" for n, y, c in zip(xs, ys, cs)) + f"; each extra stage {slope(xs, [y - c for y, c in zip(ys, cs)]):.2f} ms"
    )  # fmt: skip


def pipeline_lines(piped: list[int], runs: dict[str, list[float]]) -> None:
    """Each ring against mlx-lm's pipeline over as many ranks, and its failed tries."""
    from statistics import median

    for n in piped:
        failed = MLX_PIPELINE_FAILURES.get(n, 0)
        note = f" (its runs that failed and were tried again: {failed})" if failed else ""
        if not runs[f"mlx-lm pipeline, {n} ranks"]:
            print(f"{n} nodes: mlx-lm's pipeline gave no figure{note}")
            continue
        ring, pipe = median(runs[f"ringd local, {n} node(s)"]), median(runs[f"mlx-lm pipeline, {n} ranks"])
        print(f"{n} nodes: ringd {1000 / ring:.2f} ms per token, mlx-lm's pipeline {1000 / pipe:.2f}: ringd is {ring / pipe:.2f}x its speed{note}")


def cpu_per_stage(
    sizes: list[int], cpu: dict[str, list[float]], pieces: dict[int, list[float]], baselines: dict, split: dict[str, list[dict]], wakes: dict[str, list[float]]
) -> None:
    """The CPU table: ms per generated token (user+system) of every process of each ring, this
    code's and the baseline's, beside mlx-lm in one process evaluating each token's layers in as
    many pieces; and, over two sizes or more, the slope: what one extra stage costs."""
    from statistics import median

    print()
    print("CPU ms per generated token (user+system; a ring: every thread of every process; in-process: mlx-lm evaluating N pieces per token), median")
    columns = {"this code": "ringd local, {} node(s)", **({"baseline": "baseline, {} node(s)"} if baselines else {})}
    print(f"{'stages':<8}" + "".join(f"{name:>12}" for name in columns) + f"{'in-process':>12}")
    rows = {name: [median(cpu[f.format(n)]) for n in sizes] for name, f in columns.items()}
    rows["in-process"] = [median(pieces[n]) for n in sizes]
    for i, n in enumerate(sizes):
        print(f"{n:<8}" + "".join(f"{rows[name][i]:>12.2f}" for name in rows))
    if len(sizes) < 2:
        return
    per = {name: slope(sizes, ys) for name, ys in rows.items()}
    print(f"{'slope':<8}" + "".join(f"{per[name]:>+12.2f}" for name in rows) + "   (ms per extra stage)")
    ring = per["this code"]
    print(
        f"each extra stage costs {ring:.2f} ms of CPU per token (target <= {CPU_PER_STAGE_TARGET_MS:.2f}: "
        f"{'met' if ring <= CPU_PER_STAGE_TARGET_MS else 'not met'}); MLX's own extra evaluation {per['in-process']:.2f}, "
        f"so the ring's own work per extra stage is {ring - per['in-process']:.2f} ms"
        + (f" (the baseline's: {per['baseline']:.2f} per stage, {per['baseline'] - per['in-process']:.2f} its own)" if "baseline" in per else "")
    )  # fmt: skip
    woken = [median(wakes[columns["this code"].format(n)]) for n in sizes]
    hops = slope(sizes, woken)
    print(
        "context switches per token: " + ", ".join(f"{n} node(s) {w:.1f}" for n, w in zip(sizes, woken))
        + f"; each extra stage {hops:+.1f} (target <= {SWITCHES_PER_STAGE_TARGET}: {'met' if hops <= SWITCHES_PER_STAGE_TARGET else 'not met'})"
    )  # fmt: skip
    # Where it goes, by thread: the processes' main threads (event loops: frames in and out,
    # sealing, links, HTTP and the leader's schedule), the compute threads, MLX's stream threads.
    for name, f in columns.items():
        runs = {n: split[f.format(n)] for n in sizes}
        parts = sorted({part for n in sizes for run in runs[n] for part in run}, key=lambda p: (p != LOOP, p == OTHER, p))
        line = []
        for part in parts:
            cpu = [median(run.get(part, (0.0, 0.0))[0] for run in runs[n]) for n in sizes]
            hop = [median(run.get(part, (0.0, 0.0))[1] for run in runs[n]) for n in sizes]
            line.append(
                f"{part} " + ", ".join(f"{c:.2f} ms {w:.1f} sw" for c, w in zip(cpu, hop))
                + f" ({slope(sizes, cpu):+.2f} ms {slope(sizes, hop):+.1f} sw per extra stage)"
            )  # fmt: skip
        print(f"{name}, per token by thread at " + ", ".join(f"{n}" for n in sizes) + " node(s): " + "; ".join(line))
