"""KV capacity: the ledger (pure), and real daemons whose budgets only the whole ring can meet.

The tiny llama of these tests (6 layers, bfloat16) has 92,416 bytes per layer,
90,112 of embeddings and as many of head; a position of KV cache costs 128 bytes
per layer. With budgets of 400,000 bytes and a KV reserve of 256 positions no
single node and no pair can hold it (the whole model needs 931,456 bytes with
its reserve, three layers and an end 465,664), three can, 2-2-2; stage 0 then has
125,056 bytes of KV room: 488 positions, one request of up to 256 at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from devkit.reference import reference

from ringd.leader.admission import AdmissionError, KvLedger, StageKv
from ringd.ring.kvcost import KV_STEP_TOKENS, KvCost, KvCostError, kv_tokens

BUDGET_BYTES = 400_000
BUDGET_FLAGS = ["--memory-budget-gb", f"{BUDGET_BYTES / 2**30:.12f}", "--kv-reserve-tokens", "256"]


def test_positions_grow_in_mlx_lm_steps_and_stop_at_max_kv_size():
    assert kv_tokens(1) == KV_STEP_TOKENS == 256
    assert kv_tokens(257) == 512
    assert kv_tokens(10_000, max_kv_size=1000) == 1024


def test_the_ledger_books_every_stage_and_names_the_one_that_can_never_fit():
    ledger = KvLedger([StageKv("a", KvCost(per_token=100), 40_000), StageKv("b", KvCost(per_token=10), None)])
    assert ledger.need(300) == [51_200, 5_120]
    assert ledger.fits(200)
    ledger.book(1, 200)
    assert ledger.used() == [25_600, 2_560] and 1 in ledger
    assert ledger.fits(200) is False  # 2 x 256 positions x 100 bytes > 40,000 on a
    ledger.release(1)
    assert ledger.fits(200)
    with pytest.raises(AdmissionError, match=r"on a, which has 0\.04 MiB left"):
        ledger.check_possible(1000)
    assert ledger.status()[0] == {"node": "a", "kv_used": 0, "kv_capacity": 40_000}


def test_kv_costs_of_every_kind_of_cache():
    dense = KvCost(per_token=128)
    assert dense.bytes(1) == 128 * 256 and dense.bytes(1000) == 128 * 1024
    assert dense.bytes(10_000, max_kv_size=1000) == 128 * 1024  # a rotating cache of max_kv_size
    # kv_bits 8 of 64 two-byte elements a position, groups of 32: 64 bytes, plus a scale and a bias per group.
    assert dense.bytes(256, kv_bits=8, group_size=32) == 256 * (64 + 2 * 2 * 2)
    sliding = KvCost(per_token=100, windows=((50, 16),))
    assert sliding.bytes(1000) == 100 * 1024 + 50 * 16  # the window stops growing
    linear = KvCost(windows=(), fixed=4096, trim_limit=0)
    assert linear.bytes(1) == linear.bytes(100_000) == 4096
    for cost in (dense, sliding, linear, KvCost(per_token=1, windows=((2, 3), (4, 5)), fixed=6, itemsize=4, trim_limit=16)):
        assert KvCost.from_wire(json.loads(json.dumps(cost.to_wire()))) == cost
    for bad in (None, {}, {**dense.to_wire(), "per_token": -1}, {**dense.to_wire(), "windows": [[1]]}, {**dense.to_wire(), "x": 1}):
        with pytest.raises(KvCostError):
            KvCost.from_wire(bad)


def test_a_ledger_of_windows_and_state_books_per_request():
    ledger = KvLedger([StageKv("a", KvCost(windows=((100, 16),), fixed=1000), 10_000)])
    ledger.book(1, 5000)
    ledger.book(2, 10)
    assert ledger.used() == [2 * (100 * 16 + 1000)]  # each request's window and state, whatever its length


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def complete(c, prompt: list[int], max_tokens: int) -> tuple[int, dict, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
    return post(c.url(0) + "/v1/completions", body)


def tokens_of(body: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


PROMPT = [(i * 37) % 500 + 3 for i in range(20)]


def test_a_model_no_single_node_can_hold_is_served_by_the_ring_within_every_budget(tiny_model, cluster_factory):
    model = tiny_model(arch="llama", layers=6)
    c = cluster_factory(model, 3, extra=BUDGET_FLAGS)
    status = c.wait(lambda: (s := c.status(0)) and s.get("ready") and s, 60, "a ring within the budgets")
    assert [s[2:] for s in status["plan"]["stages"]] == [[0, 2], [2, 4], [4, 6]]
    for node in status["nodes"]:
        assert node["budget"] == BUDGET_BYTES
        assert 0 < node["parameter_bytes"] <= BUDGET_BYTES, node  # what it materialized
        assert node["kv_capacity"] == BUDGET_BYTES - {0: 274_944, 1: 184_832, 2: 275_072}[node["stage"]]
    assert all(node["speed"] and node["speed"] > 0 for node in status["nodes"])
    plan = subprocess.run(
        [sys.executable, "-m", "ringd.app.ctl", "--node", f"127.0.0.1:{c.http_ports[0]}", "plan"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert plan.count("budget 0.4 MiB") == 3 and "KV 0.0 of 0.1 MiB" in plan and "GFLOP/s" in plan, plan
    code, body, _ = complete(c, PROMPT, 40)
    assert code == 200, body
    ref, _ = reference(model, PROMPT, 40)
    assert len(set(ref)) >= 10 and tokens_of(body) == ref


def test_when_kv_runs_out_requests_wait_or_get_429_and_are_served_once_load_drops(tiny_model, cluster_factory):
    model = tiny_model(arch="llama", layers=6)
    c = cluster_factory(model, 3, extra=BUDGET_FLAGS + ["--max-queued-requests", "1"])
    c.wait(lambda: (c.status(0) or {}).get("ready"), 60, "a ring within the budgets")

    # A context that could never fit stage 0's 488 positions: 400, saying where.
    code, body, _ = complete(c, PROMPT, 600)
    assert code == 400 and "KV cache on node0" in body["error"]["message"], body

    # Room for one request of <= 256 positions at a time; one more may wait.
    results: list = [None] * 3
    started = threading.Barrier(3)

    def run(i: int) -> None:
        started.wait()
        results[i] = complete(c, PROMPT, 120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r[0] for r in results)
    assert codes == [200, 200, 429], [(r[0], r[1]) for r in results]
    refused = next(r for r in results if r[0] == 429)
    assert refused[2].get("Retry-After") and refused[1]["error"]["type"] == "rate_limit_error"
    ref, _ = reference(model, PROMPT, 120)
    assert all(tokens_of(r[1]) == ref for r in results if r[0] == 200)  # the one that waited too

    # Load has dropped: served again, and every node is still up.
    code, body, _ = complete(c, PROMPT, 120)
    assert code == 200 and tokens_of(body) == ref
    assert all(c.procs[i].poll() is None for i in range(3))
