"""A short HTTP fuzz run against a live node: schemathesis over the OpenAPI document it serves.

Every route of ``ringd/http/openapi.json`` (OpenAI's, Anthropic's and Ollama's APIs
among them) gets requests generated from its schema, valid and invalid,
against a real `ringd serve` (a ring of one, with API keys so the auth paths
are fuzzed too). No answer may be a 5xx, every refusal has its API's error
shape, and the node must still serve afterwards. The OpenAI request parser and every peer-message
parser are also fuzzed in-process (tests/http/test_openai_types.py, test_messages.py).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from ringd.http.api import OPENAPI

pytestmark = pytest.mark.slow

KEY = "fuzz-key-0123456789abcdefgh"


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    from conftest import Cluster
    from conftest import serving_leader

    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "keys").write_text(KEY + "\n")
    c = Cluster(tiny_model(arch="llama", layers=4), 1, tmp, extra=["--api-keys-file", str(tmp / "keys")])
    try:
        c.wait(lambda: serving_leader(c, [0]) == "node0", what="node0 to serve")
        yield c
    finally:
        c.stop()


# The routes, from the document the node serves (read here from the package, the same file).
OPERATIONS = [result.ok() for result in schemathesis.openapi.from_path(OPENAPI).get_all_operations()]


# Valid requests for every route; invalid ones where there is something to get wrong (a body).
CASES = [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [(op, GenerationMode.NEGATIVE) for op in OPERATIONS if len(op.body)]


@pytest.mark.parametrize(("operation", "mode"), CASES, ids=lambda v: f"{v.method.upper()} {v.path}" if hasattr(v, "path") else v.name.lower())
def test_no_route_answers_5xx(node, operation, mode):
    # (schemathesis's own pytest plugin does not run under pytest 9 yet: its strategies, driven here.)
    @given(case=operation.as_strategy(generation_mode=mode), with_key=st.booleans())
    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def run(case, with_key):
        # Half the cases with a valid key, so the parsers behind the auth check are reached.
        headers = {"Authorization": f"Bearer {KEY}"} if with_key else {}
        response = case.call(base_url=node.url(0), headers=headers, timeout=60)
        assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
        if response.status_code >= 400 and response.headers.get("Content-Type", "").startswith("application/json"):
            assert_error_shape(case.path, response.json())

    run()


def assert_error_shape(path: str, body: dict) -> None:
    """Each API refuses in its own shape: Anthropic's under /v1/messages, Ollama's under /api/, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_the_node_still_serves_after_the_fuzzing(node):
    def post(path: str, doc: dict) -> dict:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        with urllib.request.urlopen(urllib.request.Request(node.url(0) + path, data=json.dumps(doc).encode(), headers=headers), timeout=30) as r:
            assert r.status == 200
            return json.loads(r.read())

    assert post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})["choices"]
    # And embeds, through this ring of one daemon, as mlx-lm computes it in this process (the
    # mean of the decoder's final hidden states, normalized; 3 daemons: test_embeddings.py).
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    tokens = [5, 17, 99, 3, 42, 7]
    [got] = post("/v1/embeddings", {"model": "tiny", "input": [tokens]})["data"]
    h = load(str(node.model))[0].model(mx.array(tokens)[None])[0].astype(mx.float32).mean(axis=0)
    assert np.allclose(got["embedding"], np.array(h / mx.linalg.norm(h)), atol=1e-4)
    assert node.procs[0].poll() is None
    assert "unhandled error" not in node.logs[0].read_text()
