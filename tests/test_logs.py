"""logs.py: JSON and text lines that name their request, in-process and on a real ring."""

from __future__ import annotations

import io
import json
import logging
import re
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.base import logs

REQUEST_ID = "trace-7f3a:checkout/42"


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs._Context())
    handler.setFormatter(logs.JsonFormatter("mini1") if fmt == "json" else logs.TextFormatter("mini1"))
    logger = logging.getLogger(f"test.logs.{fmt}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_a_json_line_has_every_key_and_the_fields_given():
    logger, out = _capture("json")
    logger.info("req=%x: %d prompt tokens", 0xAB, 12, extra=logs.about("r-1", 7, rid="ab", prompt_tokens=12))
    line = json.loads(out.getvalue())
    assert tuple(line) == logs.JSON_KEYS
    assert line["level"] == "info" and line["node"] == "mini1" and line["logger"] == "test.logs.json"
    assert line["request_id"] == "r-1" and line["term"] == 7
    assert line["message"] == "req=ab: 12 prompt tokens"
    assert line["fields"] == {"rid": "ab", "prompt_tokens": 12}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", line["time"])


def test_lines_logged_while_serving_a_request_name_it_without_being_told():
    logger, out = _capture("json")
    token = logs.REQUEST_ID.set("handler-9")
    try:
        logger.warning("something about the request")
    finally:
        logs.REQUEST_ID.reset(token)
    logger.warning("something else")
    first, second = map(json.loads, out.getvalue().splitlines())
    assert first["request_id"] == "handler-9" and first["term"] is None and first["fields"] == {}
    assert second["request_id"] is None


def test_an_exception_is_a_field_of_one_line():
    logger, out = _capture("json")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logger.exception("it failed")
    (line,) = out.getvalue().splitlines()  # the traceback does not break the line
    assert "ValueError: bad" in json.loads(line)["fields"]["exception"]


def test_a_field_that_is_not_json_is_still_one_line():
    logger, out = _capture("json")
    logger.info("odd", extra=logs.about(path=io.StringIO, n=float("nan")))
    assert json.loads(out.getvalue())["fields"]["path"].startswith("<class")


def test_a_text_line_names_its_request_in_brackets():
    logger, out = _capture("text")
    logger.info("req=ab: done", extra=logs.about("r-2"))
    logger.info("no request here")
    first, second = out.getvalue().splitlines()
    assert " test.logs.text: [r-2] req=ab: done" in first and " mini1 I " in first
    assert second.endswith("test.logs.text: no request here")


@given(st.from_regex(r"[A-Za-z0-9._:/+=@-]{1,128}", fullmatch=True))
def test_request_ids_clients_send_are_accepted(rid):
    assert logs.check_request_id(rid) == rid


@given(st.text(min_size=0, max_size=300).filter(lambda s: not re.fullmatch(r"[A-Za-z0-9._:/+=@-]{1,128}", s)))
def test_anything_else_is_refused_with_what_is_allowed(rid):
    with pytest.raises(logs.RequestIdError, match="x-request-id must be 1 to 128 characters"):
        logs.check_request_id(rid)


def test_made_ids_are_valid_and_distinct():
    made = {logs.new_request_id() for _ in range(100)}
    assert len(made) == 100 and all(logs.check_request_id(r) for r in made)


# --- on a ring -------------------------------------------------------------------------


def _chat(url: str, content: str, headers: dict | None = None, stream: bool = False) -> tuple[int, dict, bytes]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 5, "temperature": 0, "stream": stream}
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _lines(c) -> dict[int, list[dict]]:
    out = {}
    for i, path in c.logs.items():
        out[i] = []
        for n, raw in enumerate(path.read_text().splitlines(), 1):
            try:
                line = json.loads(raw)
            except ValueError:
                raise AssertionError(f"node{i} log line {n} is not JSON: {raw!r}") from None
            assert tuple(line) == logs.JSON_KEYS, f"node{i} log line {n} has keys {tuple(line)}"
            out[i].append(line)
    return out


def test_every_line_of_a_requests_life_on_every_node_is_json_naming_it(observed_ring):
    c = observed_ring
    leader = int(c.wait(lambda: c.leader_ready(0), 60, "a ready ring")[len("node") :])
    follower = next(i for i in range(3) if i != leader)

    # Through a follower, with the client's own id, streamed: the follower's answer names it.
    status, headers, body = _chat(c.url(follower), "Tell me about rings.", {"X-Request-Id": REQUEST_ID}, stream=True)
    assert status == 200 and b"[DONE]" in body, body[-300:]
    assert headers["X-Request-Id"] == REQUEST_ID
    # Without one, the node makes one and says which.
    status, headers, _ = _chat(c.url(leader), "And about logs?")
    assert status == 200 and re.fullmatch(r"req-[0-9a-f]{16}", headers["X-Request-Id"])
    made = headers["X-Request-Id"]
    # An id that is not one is refused, saying what is allowed.
    status, _, body = _chat(c.url(follower), "Hi", {"X-Request-Id": "has spaces in it"})
    assert status == 400 and b"x-request-id must be" in body

    # The lines land as the stages finish; wait for the last stage's release of both requests.
    def ours() -> dict[int, list[dict]] | None:
        lines = _lines(c)
        named = {i: [ln for ln in lines[i] if ln["request_id"] in (REQUEST_ID, made)] for i in lines}
        releases = [ln for i in named for ln in named[i] if "released on this stage" in ln["message"] or "kept for prefix" in ln["message"]]
        return lines if len(releases) >= 2 * 3 else None

    lines = c.wait(ours, 60, "every stage to log the release of both requests")
    for request_id in (REQUEST_ID, made):
        about = {i: [ln for ln in lines[i] if ln["request_id"] == request_id] for i in range(3)}
        assert all(about[i] for i in range(3)), f"some node logged nothing about {request_id}: {about}"
        # The leader's own account: admitted, then finished, with its ring id, term and figures.
        done = [ln for ln in about[leader] if ln["fields"].get("outcome")]
        assert len(done) == 1 and done[0]["fields"]["outcome"] == "finished (length)", about[leader]
        assert done[0]["fields"]["completion_tokens"] == 5 and done[0]["term"] >= 1
        # No line on any node mentions the request's ring id without naming the request.
        rids = {ln["fields"]["rid"] for i in range(3) for ln in about[i] if "rid" in ln["fields"]}
        assert len(rids) == 1, rids
        assert all(ln["term"] is not None for i in range(3) for ln in about[i] if "rid" in ln["fields"])
        (rid,) = rids
        for i in range(3):
            for ln in lines[i]:
                if ln["fields"].get("rid") == rid or f"req={rid}" in ln["message"]:
                    assert ln["request_id"] == request_id, f"node{i}: {ln}"
    # The follower forwarded the first request, and said so under its id.
    assert any("forwarding POST /v1/chat/completions" in ln["message"] for ln in lines[follower] if ln["request_id"] == REQUEST_ID)
