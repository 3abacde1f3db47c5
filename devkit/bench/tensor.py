"""--tensor-parallel K: one stream on K Macs that split every layer, against one Mac and against
mlx-lm's own tensor parallelism; then the all-reduce's cost, and where a group stops paying.

Each process on a core of its own, as each Mac is its own: mlx-lm in this process on core 0; a
1-node ring on core 0; a ring of K nodes with ``--tensor-parallel K``, node i on core i; mlx-lm's
own tensor parallelism (``mlx.launch --backend ring``, each rank ``sharded_load(...,
tensor_group=...)``), rank i on core i. Runs interleave, ``--repeats`` of each. While it reads a
ring's stream, this process (the client: one SSE event a token) shares core 0 with node0.

The all-reduce alone, one token's hidden state (float32), each call's input the last one's sum:
ringd's between two processes over one sealed TCP connection (devkit/bench/allreduce.py: a real
TensorGroup on each side), on loopback and, with ``--link``, between two network-namespace
hosts joined by emulated links of each profile; MLX's ring backend's in the same loop on each
rank of the mlx.launch runs. Wall time per call and CPU time per call (both processes). In
the ring, the group's own histogram (``ringd_all_reduce_seconds``) adds how much later the
slower member got to each all-reduce. A group of K pays where a layer's compute ``c`` exceeds
``2 a K / (K - 1)`` (``c / K + 2 a < c``), ``a`` the all-reduce's wall time.
"""

from __future__ import annotations

import json
import os
import re
import sys
from statistics import median

from devkit.bench.allreduce import pair
from devkit.bench.measure import own_cpu_seconds, processes_cpu_s, session_pids
from devkit.bench.reference import single_process
from devkit.bench.rings import node_metrics, ring_decode, start_ring, stop_ring
from devkit.mlxlaunch import run_ranks

MLX_LM = "mlx-lm, 1 process"
ONE_NODE = "ringd local, 1 node"
MLX_TP_TRIES = 3  # its ring backend on loopback loses a peer now and then

# mlx.launch runs a program: this one pins its rank to a core, loads its slice, decodes one warm-up
# and one timed stream, then times all_sum of one token's hidden state; each rank prints JSON.
_MLX_TP_SCRIPT = """\
import json, os, sys, time
rank = int(os.environ["MLX_RANK"])
os.sched_setaffinity(0, {int(c) for c in sys.argv[5].split(",")[rank : rank + 1]})
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import sharded_load

path, prompt, tokens, calls = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
group = mx.distributed.init(backend="ring", strict=True)
model, _ = sharded_load(path, tensor_group=group)
for _ in generate_step(mx.array(prompt), model, max_tokens=8):
    pass
start = cpu = None
for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens), start=1):
    if n == 1:
        start, cpu = time.perf_counter(), time.process_time()
tps, decode_cpu = (n - 1) / (time.perf_counter() - start), (time.process_time() - cpu) / (n - 1)
x = mx.ones((1, 1, model.args.hidden_size), dtype=mx.float32)
mx.eval(x)
for _ in range(50):  # each call's input the last call's sum, halved, as devkit/bench/allreduce.py does
    x = mx.distributed.all_sum(x * 0.5, group=group)
    mx.eval(x)
start, cpu = time.perf_counter(), time.process_time()
for _ in range(calls):
    x = mx.distributed.all_sum(x * 0.5, group=group)
    mx.eval(x)
wall, reduce_cpu = (time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls
print("RANK " + json.dumps({"rank": rank, "tps": tps, "cpu": decode_cpu, "all_sum": wall, "all_sum_cpu": reduce_cpu}), flush=True)
"""
ALL_SUM_CALLS = 500
ALL_REDUCE_CALLS = 2000  # per figure of ringd's on loopback (a quarter over an emulated link)


def pin_nodes(session: int, cores: list[int]) -> None:
    """Node i of the ring whose ``ringd local`` is ``session`` on ``cores[i]`` (by start order), every
    thread, and a node's group process (``--tensor-engine mlx-ring``) on its node's core."""
    import psutil

    pids = [pid for pid in session_pids(session) if pid != session]
    nodes = [pid for pid in pids if psutil.Process(pid).ppid() == session]
    where = dict(zip(nodes, cores))
    for pid in pids:
        core = where.get(pid, where.get(psutil.Process(pid).ppid()))
        if core is None:
            continue
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except ProcessLookupError:
                pass


def mlx_tensor_parallel(model_path: str, ranks: int, prompt: list[int], tokens: int) -> list[dict] | None:
    """One run of mlx-lm's own tensor parallelism over ``ranks`` pinned ranks: each rank's figures,
    or None if every try lost a peer."""

    def figures(stdout: str) -> list[dict] | None:
        found = [json.loads(m) for m in re.findall(r"^RANK (\{.*\})$", stdout, re.M)]
        return sorted(found, key=lambda d: d["rank"]) if len(found) == ranks else None

    args = [model_path, json.dumps(prompt), str(tokens), str(ALL_SUM_CALLS), ",".join(map(str, range(ranks)))]
    found, stderr = run_ranks(_MLX_TP_SCRIPT, args, ranks, figures, MLX_TP_TRIES, 900)
    if found is None:
        print(f"bench: mlx-lm's tensor parallelism over {ranks} ranks failed {MLX_TP_TRIES} times; the last:\n{stderr[-1500:]}", file=sys.stderr)
    return found


def all_reduce_seconds(url: str) -> tuple[float, int]:
    """Seconds and count of the group's all-reduces so far (every member's ringd_all_reduce_seconds)."""
    total = count = 0.0
    for text in node_metrics(url):
        total += sum(float(v) for v in re.findall(r"^ringd_all_reduce_seconds_sum\{[^}]*\} (\S+)$", text, re.M))
        count += sum(float(v) for v in re.findall(r"^ringd_all_reduce_seconds_count\{[^}]*\} (\S+)$", text, re.M))
    return total, int(count)


def tensor_parallel(args, model, model_path: str, prompt: list[int], no_eos: list[int]) -> None:
    from devkit.netns import NetnsHosts

    k = args.tensor_parallel
    if len(os.sched_getaffinity(0)) < k:
        raise SystemExit(f"bench: --tensor-parallel {k} puts each node on a core of its own; this process may use {len(os.sched_getaffinity(0))}")
    tp_ring = f"ringd local, {k} nodes, --tensor-parallel {k}"
    mlx_tp = f"mlx-lm tensor parallel, {k} ranks"
    # The same group on MLX's TCP ring backend, in group processes (the path jaccl takes on Macs).
    mlx_ring = f"ringd local, {k} nodes, --tensor-engine mlx-ring"
    runs: dict[str, list[float]] = {MLX_LM: [], ONE_NODE: [], tp_ring: [], mlx_ring: [], mlx_tp: []}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    reduce_ms, mlx_sum = [], []
    os.sched_setaffinity(0, {0})
    one = start_ring(model_path, 1)
    group = start_ring(model_path, k, tensor_parallel=k)
    on_mlx = start_ring(model_path, k, tensor_parallel=k, tensor_engine="mlx-ring")
    pin_nodes(one[0].pid, [0])
    pin_nodes(group[0].pid, list(range(k)))
    pin_nodes(on_mlx[0].pid, list(range(k)))
    try:
        for _, url in (one, group, on_mlx):
            ring_decode(url, prompt, 8, no_eos)  # warm-up: first-use allocations on every node
        for r in range(args.repeats):
            before = own_cpu_seconds()
            runs[MLX_LM].append(single_process(model, prompt, args.tokens))
            cpu[MLX_LM].append(1000 * (own_cpu_seconds() - before) / args.tokens)
            for name, (proc, url) in ((ONE_NODE, one), (tp_ring, group), (mlx_ring, on_mlx)):
                before, reduced = processes_cpu_s([proc.pid]), all_reduce_seconds(url)
                runs[name].append(ring_decode(url, prompt, args.tokens, no_eos))
                cpu[name].append(1000 * (processes_cpu_s([proc.pid]) - before) / args.tokens)
                if name == tp_ring:
                    after = all_reduce_seconds(url)
                    reduce_ms.append(1000 * (after[0] - reduced[0]) / max(1, after[1] - reduced[1]))
            ranks = mlx_tensor_parallel(model_path, k, prompt, args.tokens)
            if ranks is not None:
                runs[mlx_tp].append(ranks[0]["tps"])
                cpu[mlx_tp].append(1000 * sum(d["cpu"] for d in ranks))
                mlx_sum.append((1000 * median(d["all_sum"] for d in ranks), 1000 * sum(d["all_sum_cpu"] for d in ranks)))
            print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in runs.items() if v), flush=True)
    finally:
        stop_ring(one[0])
        stop_ring(group[0])
        stop_ring(on_mlx[0])
    hidden = model.args.hidden_size
    alone = {"loopback": [pair(hidden, ALL_REDUCE_CALLS) for _ in range(args.repeats)]}
    for name in args.link.split(",") if args.link else ():
        with NetnsHosts(2, links=[name, name]) as net:
            alone[name] = [pair(hidden, ALL_REDUCE_CALLS // 4, net=net) for _ in range(args.repeats)]
    report(args, model, runs, cpu, reduce_ms, mlx_sum, (tp_ring, mlx_ring, mlx_tp), alone)


def report(args, model, runs, cpu, reduce_ms, mlx_sum, names: tuple[str, str, str], alone: dict) -> None:
    tp_ring, mlx_ring, mlx_tp = names
    k, layers = args.tensor_parallel, len(model.layers)
    base = median(runs[MLX_LM])
    print()
    print(f"one stream, decode tokens/s, {args.tokens} tokens, {args.repeats} interleaved runs, each process on its own core")
    print(f"{'configuration':<44}{'median':>9}{'min':>9}{'max':>9}{'ratio':>9}{'CPU ms/token':>14}")
    for name, values in runs.items():
        if values:
            print(f"{name:<44}{median(values):>9.2f}{min(values):>9.2f}{max(values):>9.2f}{median(values) / base:>9.3f}{median(cpu[name]):>14.1f}")
    if runs[mlx_tp]:
        print(f"{tp_ring} against {mlx_tp}: {median(runs[tp_ring]) / median(runs[mlx_tp]):.3f}x")
    print(f"the group on ringd's collective against MLX's ring backend (group processes): {median(runs[tp_ring]) / median(runs[mlx_ring]):.3f}x")
    print(f"in the ring: {median(reduce_ms) * 1000:.0f} us a member waits per all-reduce (ringd_all_reduce_seconds; {2 * layers} a token)")
    print()
    print(f"one all-reduce of one token's hidden state ({model.args.hidden_size} float32), back to back, median (min-max) of {args.repeats}")
    rows = [(f"ringd, {where}", [1000 * f["wall"] for f in figs], [1000 * f["cpu"] for f in figs]) for where, figs in alone.items()]
    if mlx_sum:
        rows.insert(1, ("MLX ring backend, loopback", [w for w, _ in mlx_sum], [c for _, c in mlx_sum]))
    print(f"{'collective':<30}{'wall us':>22}{'CPU us':>22}{'group of ' + str(k) + ' pays above':>26}")
    for name, wall, cpu_ms in rows:
        a = median(wall)
        print(
            f"{name:<30}{_spread(wall):>22}{_spread(cpu_ms):>22}"
            f"{f'{2 * a * k / (k - 1):.3f} ms a layer':>26}"
        )  # fmt: skip
    print(f"(a layer's compute c pays when c/{k} + 2a < c; here a layer is {1000 / base / layers:.2f} ms: mlx-lm, one core, {layers} layers)")


def _spread(values_ms: list[float]) -> str:
    """Median (min-max) in microseconds."""
    us = [1000 * v for v in values_ms]
    return f"{median(us):.0f} ({min(us):.0f}-{max(us):.0f})"
