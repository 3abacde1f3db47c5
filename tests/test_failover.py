"""A stage dies mid-generation: the leader re-plans over the survivors and the stream carries on.

Real `ringd local` rings, real kill -9 of a node process, the real openai client.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from devkit.rings import Ring
from devkit.clients import stream_text
from devkit.faults import SignalAt

TOKENS = 400


def node_pid(ring: Ring, name: str) -> int:
    """The pid of the `ringd serve --name NAME` process that `ringd local` started."""

    def serves(args: list[str]) -> bool:
        return "serve" in args and "--name" in args[:-1] and args[args.index("--name") + 1] == name

    found = [c.pid for c in psutil.Process(ring.proc.pid).children() if serves(c.cmdline())]
    assert len(found) == 1, f"expected one `ringd serve --name {name}` under ringd local ({ring.proc.pid}), got {found}"
    return found[0]


def cluster(ring: Ring) -> dict:
    with urllib.request.urlopen(ring.url + "/cluster/status", timeout=10) as r:
        return json.loads(r.read())


# A long answer the grammar holds to its shape: the last stage that samples it dies
# midway, and the new one must rebuild the grammar's state from the replayed tokens.
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 80, "maxItems": 80}


@pytest.mark.parametrize(
    ("victim", "model_args", "schema"),
    [
        ("node1", dict(arch="qwen3_moe", layers=6), None),
        ("node2", dict(arch="llama", layers=7, dtype="bfloat16"), None),
        ("node2", dict(arch="llama", layers=7, dtype="bfloat16"), NUMBERS),
    ],
    ids=["middle-stage-moe", "last-stage", "last-stage-json-schema"],
)
def test_kill_9_of_a_stage_mid_stream_loses_nothing(tiny_model, victim, model_args, schema):
    model = tiny_model(**model_args)
    messages = [{"role": "user", "content": "Tell me everything about rings."}]
    ring = Ring(model, nodes=3)
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}}} if schema else {}
    try:
        whole, finish = stream_text(ring.base_url, messages, TOKENS, model=ring.model_id, **extra)
        if schema:
            assert finish == "stop" and len(json.loads(whole)) == 80, whole
        else:
            assert finish == "length"
        kill_at = SignalAt(node_pid(ring, victim), signal.SIGKILL, 30)
        t0 = time.monotonic()
        again, finish = stream_text(ring.base_url, messages, TOKENS, kill_at, model=ring.model_id, **extra)
        assert kill_at.fired.is_set()
        assert finish == ("stop" if schema else "length")
        assert again == whole, "the stream after failover differs from the uninterrupted run"
        status = cluster(ring)
        assert [s[0] for s in status["plan"]["stages"]] == ["node0", sorted({"node1", "node2"} - {victim})[0]]
        assert status["plan"]["term"] >= 2
        print(f"stream with {victim} killed at chunk 30 took {time.monotonic() - t0:.2f} s")
    finally:
        ring.stop()


def test_survivors_too_small_get_a_503_naming_the_shortfall_on_every_node(tiny_model, tmp_path):
    from devkit.cluster import Cluster
    from devkit.cluster import serving_leader

    model = tiny_model(arch="llama", layers=8, hidden_size=128, dtype="float32")
    from ringd.models.source import model_info

    weights = model_info(str(model)).weights
    # Each node can hold a little less than half the model: three fit, two do not.
    budget_gb = (weights.stage(0, 8) * 0.45) / 2**30
    # No KV reserve in placement: the budgets are about the weights here.
    c = Cluster(model, 3, tmp_path, extra=["--memory-budget-gb", f"{budget_gb:.9f}", "--kv-reserve-tokens", "1"])
    try:
        c.wait(lambda: serving_leader(c, range(3)) == "node0", what="node0 to serve a ring of three")
        client = openai.OpenAI(base_url=c.url(0) + "/v1", api_key="not-needed", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert r.choices[0].message.content is not None
        c.signal(2, signal.SIGKILL)

        def refused(i):
            try:
                urllib.request.urlopen(c.url(i) + "/health", timeout=5)
            except urllib.error.HTTPError as e:
                body = json.loads(e.read())
                return body if "does not fit" in body.get("reason", "") else None
            return None

        body = c.wait(lambda: refused(0), 20, "the leader to say the model does not fit")
        assert "node0 needs" in body["reason"] and "short by" in body["reason"], body
        # A follower does not say "ok" while the cluster cannot serve: it says why.
        follower = c.wait(lambda: refused(1), 20, "the follower to say so too")
        assert follower["status"] == "unavailable" and "the leader node0 does not serve" in follower["reason"], follower
        for url in (c.url(0), c.url(1)):
            client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
            with pytest.raises(openai.APIStatusError) as e:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
            assert e.value.status_code == 503
    finally:
        c.stop()


STREAMS = 8


def test_kill_9_of_a_middle_stage_with_8_batched_streams_in_flight_loses_nothing(tiny_model):
    """Eight streams decoding together (micro-batches of several rows at every stage) when the
    middle stage dies: every stream's text equals its uninterrupted run's (float32, so the
    batches' different make-up after the replay cannot tip a near tie)."""
    model = tiny_model(arch="llama", layers=6, dtype="float32")
    asks = [[{"role": "user", "content": f"Tell me everything about ring number {i}."}] for i in range(STREAMS)]
    ring = Ring(model, nodes=3)

    def all_at_once(kill=None) -> list[tuple[str, str | None]]:
        results: list = [None] * STREAMS

        def run(i):
            results[i] = stream_text(ring.base_url, asks[i], 120, kill if i == 0 else None, model=ring.model_id)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        return results

    try:
        whole = all_at_once()
        assert all(r is not None and r[1] == "length" for r in whole), whole
        kill_at = SignalAt(node_pid(ring, "node1"), signal.SIGKILL, 20)
        again = all_at_once(kill_at)
        assert kill_at.fired.is_set()
        for i, (before, after) in enumerate(zip(whole, again)):
            assert after == before, f"stream {i} after failover differs from its uninterrupted run"
        assert [s[0] for s in cluster(ring)["plan"]["stages"]] == ["node0", "node2"]
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(ring.url + "/metrics", timeout=10).read().decode()
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "ringd_micro_batch_rows"]
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        alone = next(s.value for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] == "1.0")
        assert count > alone, "no micro-batch held more than one row"
    finally:
        ring.stop()


def test_kill_9_of_a_stage_mid_stream_with_an_image_loses_nothing(tiny_vision_model):
    """A prompt with an image on Qwen2.5-VL (its positions by time, row and column): the ring that
    replays it sends the image to its first stage again, whose tower sees it again, and every
    position is placed as before, so the stream goes on as it would have."""
    from devkit.pictures import data_url, gradient

    ring = Ring(tiny_vision_model("qwen2_5_vl"), nodes=3, model_id="see")
    content = [{"type": "image_url", "image_url": {"url": data_url(gradient(48, 80))}}, {"type": "text", "text": "Describe the image."}]
    messages = [{"role": "user", "content": content}]
    try:
        whole, finish = stream_text(ring.base_url, messages, 60, model="see", extra_body={"ignore_eos": True})
        assert finish == "length" and len(set(whole)) > 5
        kill_at = SignalAt(node_pid(ring, "node1"), signal.SIGKILL, 10)
        again, finish = stream_text(ring.base_url, messages, 60, kill_at, model="see", extra_body={"ignore_eos": True})
        assert kill_at.fired.is_set() and finish == "length"
        assert again == whole, "the stream after failover differs from the uninterrupted run"
        assert cluster(ring)["plan"]["term"] >= 2
    finally:
        ring.stop()
