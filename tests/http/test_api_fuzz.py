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
import urllib.error
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
    from devkit.cluster import Cluster
    from devkit.cluster import serving_leader

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


# Cases sent and 5xx answers over the schemathesis run, for the closing line of the run.
SCHEMA_RUN = {"cases": 0, "5xx": 0}


@pytest.mark.parametrize(("operation", "mode"), CASES, ids=lambda v: f"{v.method.upper()} {v.path}" if hasattr(v, "path") else v.name.lower())
def test_no_route_answers_5xx(node, operation, mode):
    # (schemathesis's own pytest plugin does not run under pytest 9 yet: its strategies, driven here.)
    @given(case=operation.as_strategy(generation_mode=mode), with_key=st.booleans())
    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def run(case, with_key):
        # Half the cases with a valid key, so the parsers behind the auth check are reached.
        headers = {"Authorization": f"Bearer {KEY}"} if with_key else {}
        response = case.call(base_url=node.url(0), headers=headers, timeout=60)
        SCHEMA_RUN["cases"] += 1
        SCHEMA_RUN["5xx"] += response.status_code >= 500
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


# --- nested objects and lists in every field position (issue 28, item 5) --------------------------

# A body for each route that reads one, holding every kind of part it takes (messages of each
# role, tool calls and results, tools, formats, options), so every position below is reached.
# (A key's trailing space: a second body for the same route, formats being refused beside tools.)
_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_FN = {"name": "get_weather", "description": "weather", "parameters": _SCHEMA}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
BASES = {
    "/v1/chat/completions": {
        "model": "tiny", "max_tokens": 1, "temperature": 0, "stop": ["x"], "logit_bias": {"5": 1},
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]},
            {"role": "assistant", "content": None, "tool_calls": [_CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": _FN}],
        "stream_options": {"include_usage": True},
    },
    "/v1/completions": {
        "model": "tiny", "prompt": "hi", "max_tokens": 1, "stop": ["x"], "logprobs": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": _SCHEMA}},
    },
    "/v1/responses": {
        "model": "tiny", "max_output_tokens": 1, "instructions": "i", "tool_choice": {"type": "function", "name": "get_weather"},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "u"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": [{"type": "function", **_FN}],
    },
    "/v1/responses ": {"model": "tiny", "max_output_tokens": 1, "input": "u", "text": {"format": {"type": "json_schema", "name": "w", "schema": _SCHEMA}}},
    "/v1/embeddings": {"model": "tiny", "input": ["a", "b"], "encoding_format": "float"},
    "/v1/messages": {
        "model": "tiny", "max_tokens": 1, "system": [{"type": "text", "text": "s"}], "stop_sequences": ["x"], "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}]},
        ],
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": _SCHEMA}],
    },
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "u"}], "tools": [{"name": "f", "input_schema": _SCHEMA}]},
    "/api/chat": {
        "model": "tiny", "stream": False, "options": {"num_predict": 1, "temperature": 0, "stop": ["x"]},
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": _FN}],
    },
    "/api/generate": {"model": "tiny", "prompt": "hi", "system": "s", "stream": False, "options": {"num_predict": 1}, "format": _SCHEMA},
    "/api/embed": {"model": "tiny", "input": ["a"], "options": {"temperature": 0}},
    "/api/embeddings": {"model": "tiny", "prompt": "a"},
    "/api/show": {"model": "tiny"},
}  # fmt: skip

# What goes in a position: objects and lists nested in each other, and scalars inside them.
NESTED = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
).filter(lambda v: isinstance(v, (list, dict)))


def positions(body, path=()):
    """The path of every value in ``body``: each key's value and each list item, at every depth."""
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for k, v in items:
        yield (*path, k)
        yield from positions(v, (*path, k))


def put(body, path, value):
    body = json.loads(json.dumps(body))
    at = body
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return body


# Cases sent and 5xx answers, over the test below, for its closing line.
NESTED_RUN = {"cases": 0, "5xx": 0}


@pytest.mark.parametrize("route", list(BASES))
def test_nested_objects_and_lists_in_every_field_position_are_never_a_5xx(node, route):
    base = BASES[route]
    route = route.strip()
    op = next(o for o in OPERATIONS if o.path == route and o.method.lower() == "post")
    body_schema = op.definition.raw["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in body_schema:
        body_schema = json.loads(OPENAPI.read_text())["components"]["schemas"][body_schema["$ref"].split("/")[-1]]
    # Every position the base holds, and every field the route's document names that it does not.
    paths = list(positions(base)) + [(k,) for k in body_schema.get("properties", {}) if k not in base]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    # The base itself is served: each position below is reached, not refused for another field.
    def send(body: dict) -> tuple[int, bytes]:
        request = urllib.request.Request(node.url(0) + route, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    status, text = send(base)
    assert status == 200, text
    for path in paths:

        @given(value=NESTED)
        @settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
        def run(value):
            status, text = send(put(base, path, value))
            NESTED_RUN["cases"] += 1
            NESTED_RUN["5xx"] += status >= 500
            assert status < 500, f"{route} with {'.'.join(map(str, path))} = {value!r} -> {status}: {text[:500]!r}"
            if status >= 400:
                assert_error_shape(route, json.loads(text))

        run()
    print(f"\n{route}: {len(paths)} positions; so far {NESTED_RUN['cases']} cases, {NESTED_RUN['5xx']} answered 5xx")


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
    # The run's figures (in this worker: the tests of this module share one): cases, and 5xx (none).
    print(f"\nfuzz run: schemathesis {SCHEMA_RUN['cases']} cases, {SCHEMA_RUN['5xx']} 5xx; nested values in every position {NESTED_RUN['cases']} cases, {NESTED_RUN['5xx']} 5xx")
