"""Tensor-parallel groups end to end: real `ringd local` rings whose stages are groups of daemon
processes, against mlx-lm's own tensor parallelism (``sharded_load(..., tensor_group=...)`` over
``mlx.launch --backend ring``), and a group member killed or stopped mid-stream.

The all-reduce's mechanics are proven in-process (tests/stage/test_tensorgroup.py); these prove
the same through processes and TCP.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import time

import psutil
import pytest

from devkit.clients import stream_text
from devkit.faults import SignalAt
from devkit.reference import mlx_tensor_parallel
from devkit.rings import Ring
from tests.test_failover import cluster, node_pid

MAX_TOKENS = 16
# Prompts of different lengths: batched, their caches are left-padded differently.
PROMPTS = [[1, 5, 9, 33, 2, 7, 44, 12, 19, 3], [4, 8, 15, 16, 23, 42, 11, 3, 9], [7, 7, 3, 99, 100, 101], [50, 2, 60, 3, 70]]
ARCHS = [("llama", "bfloat16"), ("qwen3", "bfloat16"), ("qwen3_moe", "float32")]


@functools.cache
def reference(model) -> dict:
    """mlx-lm's own tensor parallelism's greedy tokens over 2 ranks (one `mlx.launch` run a model)."""
    return mlx_tensor_parallel(model, PROMPTS, MAX_TOKENS, ranks=2)


def greedy(ring: Ring, prompt: list[int]) -> list[int]:
    r = ring.client().completions.create(
        model=ring.model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


@pytest.mark.parametrize(("arch", "dtype"), ARCHS, ids=[a for a, _ in ARCHS])
def test_groups_answer_as_mlx_lm_tensor_parallelism(tiny_model, arch, dtype):
    """`--nodes 2 --tensor-parallel 2` (one group) and `--nodes 4 --tensor-parallel 2` (two stages
    of two) give mlx-lm's own tensor parallelism's greedy tokens over 2 ranks, one request at a
    time and four at once (micro-batches of several rows)."""
    model = tiny_model(arch=arch, layers=4, dtype=dtype)
    ref = reference(model)
    assert ref["plain"] == ref["batched"], "mlx-lm's own batched and plain answers differ: the test would prove nothing"
    # An equality test proves nothing if the model repeats one token.
    assert len({t for tokens in ref["plain"] for t in tokens}) >= 20, f"reference output too uniform: {ref['plain']}"
    for nodes in (2, 4):
        ring = Ring(model, nodes, tensor_parallel=2)
        try:
            stages = cluster(ring)["plan"]["stages"]
            assert len(stages) == nodes // 2, stages
            plain = [greedy(ring, p) for p in PROMPTS]
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                together = list(pool.map(lambda p: greedy(ring, p), PROMPTS))
        finally:
            ring.stop()
        assert plain == ref["plain"], f"{nodes} nodes in groups of 2, one at a time:\nring {plain}\nref  {ref['plain']}"
        assert together == ref["batched"], f"{nodes} nodes in groups of 2, all at once:\nring {together}\nref  {ref['batched']}"


STREAMS = 4


def test_groups_on_mlx_s_own_collective_answer_alike_and_survive_their_process(tiny_model):
    """`tensor_engine: mlx-ring`: each member runs its slice in a group process on MLX's own
    collective (the path jaccl takes on Macs with RDMA, here with MLX's TCP ring backend, as RDMA
    cannot exist on Linux). A group of two gives mlx-lm's tensor parallelism's tokens, plain and
    batched; a group process killed mid-stream breaks its stage like a dead Mac: the ring re-forms
    the group and every stream ends whole. (Pipeline and tensor together, and every architecture,
    are the ringd engine's tests above: the group process runs the same StageRunner.)"""
    model = tiny_model(arch="llama", layers=4, dtype="bfloat16")
    ref = reference(model)
    asks = [[{"role": "user", "content": f"Tell me everything about ring number {i}."}] for i in range(STREAMS)]
    ring = Ring(model, 2, tensor_parallel=2, tensor_engine="mlx-ring")
    try:
        status = cluster(ring)
        assert {n["node"]: n["engine"] for n in status["nodes"]} == {"node0": "mlx-ring", "node1": "mlx-ring"}, status["nodes"]
        plain = [greedy(ring, p) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: greedy(ring, p), PROMPTS))
        assert plain == ref["plain"], f"one at a time:\nring {plain}\nref  {ref['plain']}"
        assert together == ref["batched"], f"all at once:\nring {together}\nref  {ref['batched']}"

        def all_at_once(kill=None) -> list:
            with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
                return list(pool.map(lambda i: stream_text(ring.base_url, asks[i], 40, kill if i == 0 else None, model=ring.model_id), range(STREAMS)))

        whole = all_at_once()
        [worker] = [c.pid for c in psutil.Process(node_pid(ring, "node1")).children() if "ringd.stage.groupworker" in c.cmdline()]
        kill_at = SignalAt(worker, signal.SIGKILL, 15)
        again = all_at_once(kill_at)
        assert kill_at.fired.is_set()
        assert again == whole, "streams after a group process's death differ from their uninterrupted runs"
        # Said once the daemon has heard its process end, which may come after the streams
        # (their last tokens can be computed before the kill lands): waited for, not assumed.
        deadline = time.monotonic() + 60
        while "its group process ended" not in (logs := ring.logs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "its group process ended" in logs, logs[-3000:]
    finally:
        ring.stop()


def _stages(ring: Ring) -> list[str]:
    """The first node of each stage of the ring serving now ([] while it is not ready)."""
    status = cluster(ring)
    return [s[0] for s in status["plan"]["stages"]] if status.get("ready") else []


def test_kill_9_of_a_group_member_mid_stream_loses_nothing(tiny_model):
    """Four streams through a ring of two groups of two; one member of the second group dies:
    the plan re-forms (one group of the survivors), every stream is replayed and ends whole,
    as it would have without the fault."""
    model = tiny_model(arch="llama", layers=4, dtype="float32")
    asks = [[{"role": "user", "content": f"Tell me everything about ring number {i}."}] for i in range(STREAMS)]
    ring = Ring(model, nodes=4, tensor_parallel=2)

    def all_at_once(kill=None) -> list:
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            return list(pool.map(lambda i: stream_text(ring.base_url, asks[i], 120, kill if i == 0 else None, model=ring.model_id), range(STREAMS)))

    try:
        whole = all_at_once()
        assert all(finish == "length" for _, finish in whole), whole
        kill_at = SignalAt(node_pid(ring, "node3"), signal.SIGKILL, 20)
        again = all_at_once(kill_at)
        assert kill_at.fired.is_set()
        for i, (before, after) in enumerate(zip(whole, again)):
            assert after == before, f"stream {i} after the member's death differs from its uninterrupted run"
        plan = cluster(ring)["plan"]
        assert [s[0] for s in plan["stages"]] == ["node0"], plan
    finally:
        ring.stop()


def test_the_last_member_standing_serves_alone(tiny_model):
    """A ring that is one group of two loses a member mid-stream: fewer Macs than a group, so the
    survivor serves the whole model alone, and the stream carries on as it would have."""
    model = tiny_model(arch="llama", layers=4, dtype="float32")
    ask = [{"role": "user", "content": "Tell me everything about rings."}]
    ring = Ring(model, nodes=2, tensor_parallel=2)
    try:
        whole = stream_text(ring.base_url, ask, 80, model=ring.model_id)
        kill_at = SignalAt(node_pid(ring, "node1"), signal.SIGKILL, 20)
        assert stream_text(ring.base_url, ask, 80, kill_at, model=ring.model_id) == whole
        assert kill_at.fired.is_set()
        assert cluster(ring)["plan"]["stages"] == [["node0", cluster(ring)["plan"]["stages"][0][1], 0, 4]]
    finally:
        ring.stop()


def test_sigstop_of_a_group_member_for_5_s_heals(tiny_model):
    """A member of the leader's own group stops for 5 s (a Mac asleep) while four streams run:
    they end whole, the ring heals with the member back in its group, and serves."""
    model = tiny_model(arch="llama", layers=4, dtype="float32")
    asks = [[{"role": "user", "content": f"Tell me everything about ring number {i}."}] for i in range(STREAMS)]
    ring = Ring(model, nodes=4, tensor_parallel=2)
    try:
        pid = node_pid(ring, "node1")
        stop_at = SignalAt(pid, signal.SIGSTOP, 20, resume_after_s=5.0)
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            results = list(pool.map(lambda i: stream_text(ring.base_url, asks[i], 120, stop_at if i == 0 else None, model=ring.model_id), range(STREAMS)))
        assert stop_at.fired.is_set()
        assert all(finish == "length" and text for text, finish in results), results
        deadline = time.monotonic() + 60
        while not (healed := _stages(ring) == ["node0", "node2"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert healed, f"the ring did not heal with node1 back in 60 s: {cluster(ring)}"
        assert stream_text(ring.base_url, asks[0], 20, model=ring.model_id)[1] == "length"
    finally:
        os.kill(pid, signal.SIGCONT)
        ring.stop()


def test_a_model_that_fits_only_four_ways_is_served_by_a_group_of_four(tiny_model):
    """Budgets under what one Mac, or a pair, needs for the model: a group of four serves it, each
    member holding a quarter of every layer (and the embeddings and head whole, as shard() leaves them)."""
    from ringd.cluster.placement import ModelCost
    from ringd.models.source import model_info

    model = tiny_model(arch="llama", layers=4, hidden_size=256, heads=8, kv_heads=4, dtype="float32")
    info = model_info(str(model))
    cost = ModelCost.of(info, kv_reserve_tokens=1)
    layers = info.num_layers
    whole, pair, four = (cost.per_member(k).stage_need(0, layers) for k in (1, 2, 4))
    budget = (four + pair) / 2  # a quarter of every layer fits; half of them does not
    ring = Ring(model, 4, tensor_parallel=4, env={"RINGD_MEMORY_BUDGET_GB": f"{budget / 2**30:.12f}", "RINGD_KV_RESERVE_TOKENS": "1"})
    try:
        status = cluster(ring)
        [stage] = status["plan"]["stages"]
        assert stage[0] == "node0" and [m[0] for m in stage[4]] == ["node1", "node2", "node3"], stage
        held = {n["node"]: n["parameter_bytes"] for n in status["nodes"]}
        ends = info.weights.embed + info.weights.norm + (info.weights.head or 0)
        for node, nbytes in held.items():
            assert nbytes <= budget < pair, f"{node} holds {nbytes} bytes"
            assert abs((nbytes - ends) - sum(info.weights.layers) / 4) <= 0.02 * sum(info.weights.layers) / 4, f"{node} holds {nbytes - ends} bytes of layers"
        assert greedy(ring, PROMPTS[0])
    finally:
        ring.stop()
    assert whole > budget


# --- tensor_parallel auto over shaped links: two rooms of two Macs ---------------------------

# Run inside host 0's namespace: wait until the leader serves a plan of two groups of two, then
# ask ringctl plan and chat through the ring.
_NS_WAIT = r"""
import json, subprocess, sys, time, urllib.request
url, within, secret = sys.argv[1], float(sys.argv[2]), sys.argv[3]
body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}).encode()
deadline, last, failed = time.monotonic() + within, None, None
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url + "/cluster/status", timeout=5) as r:
            status = json.loads(r.read())
        stages = status["plan"]["stages"] if status.get("plan") else []
        last = {"reason": status.get("reason"), "stages": stages}
        groups = [sorted([s[0]] + [m[0] for m in (s[4] if len(s) > 4 else [])]) for s in stages]
        if status["ready"] and sorted(groups) == [["host0", "host1"], ["host2", "host3"]]:
            plan = subprocess.run([sys.executable, "-m", "ringd.app.ctl", "--node", url.removeprefix("http://"), "--secret-file", secret, "plan"],
                                  capture_output=True, text=True, timeout=30)
            req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                chat = json.loads(r.read())
            print(json.dumps({"status": status, "plan": plan.stdout + plan.stderr, "chat": chat}))
            sys.exit(0)
    except Exception as e:
        failed = repr(e)
    time.sleep(0.5)
print(json.dumps({"error": last, "failed": failed}))
sys.exit(1)
"""


def test_auto_groups_the_macs_of_each_room_and_pipelines_between_rooms(tiny_model, tmp_path):
    """Four daemons on network-namespace hosts, two rooms of two joined inside by Thunderbolt and
    between by a slow link (devkit/linkshape.py). With tensor_parallel auto the first plan has no
    groups (no link is measured yet); once the leader has measured the links, each room's Macs
    form a group and the pipeline crosses between the rooms, and ringctl plan says why."""
    import json
    import subprocess
    import sys

    from devkit import REPO
    from devkit.linkshape import Profile
    from devkit.netns import NetnsHosts, netns_available

    reason = netns_available()
    assert reason is None, f"cannot build test hosts: {reason}"
    # A layer of ~46 M bfloat16 parameters: ~49 ms by this VM's probed 1.85 GFLOP/s. A pair pays
    # above four all-reduces, 5-21 ms over Thunderbolt as this VM reads it (a round trip of 2 ms
    # idle, 10 ms loaded): a token of ~150-180 ms in pairs against ~240 ms without, past the 20%
    # margin either way; four Macs in one group would all-reduce across the 20 ms link between
    # the rooms eight times a token (~210 ms).
    model = tiny_model(arch="llama", layers=4, hidden_size=2048, heads=16, kv_heads=4, dtype="bfloat16")
    secret = tmp_path / "secret"
    secret.write_text("t" * 32)
    secret.chmod(0o600)
    slow = Profile("between-rooms", 20e-3, 0.5e-3, 0.0, 1e9, 1500)
    with NetnsHosts(4, links=["thunderbolt"] * 4, segments=[0, 0, 1, 1], uplink=slow) as net:
        logs = [tmp_path / f"host{i}.log" for i in range(4)]
        for i in range(4):
            net.serve(
                i, logs[i], name=f"host{i}", cluster="rooms-tp", secret_file=secret, model=model, model_id="tiny",
                state_dir=tmp_path / "state", tensor_parallel="auto", kv_reserve_tokens=16,
            )  # fmt: skip
        wait = [sys.executable, "-c", _NS_WAIT, f"http://{net.hosts[0].ip}:8100", "180", str(secret)]
        done = subprocess.run(net.exec_prefix(0) + wait, capture_output=True, text=True, timeout=210, cwd=REPO)

        def tails() -> str:
            return "\n".join(f"--- host{i}\n{p.read_text()[-3000:]}" for i, p in enumerate(logs))

        assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{tails()}"
        result = json.loads(done.stdout)
        print(result["plan"])
        assert result["chat"]["choices"][0]["message"]["content"] is not None
        assert "tensor_parallel auto: groups of 2 (" in result["plan"] and "pays above" in result["plan"], result["plan"]
        assert "a tensor-parallel group of 2" in result["plan"], result["plan"]
        log = "\n".join(p.read_text() for p in logs)
        assert "tensor_parallel auto: no groups: links not measured yet" in log, "the first plan, before any link was measured, should have had no groups"
