"""Every descriptor a peer can send, fuzzed: each parser answers with its own error, never another exception.

Heartbeats, CONTROL and LOADED (``ringd.cluster.messages``), PLAN (``Plan.from_wire``),
ERROR (``ringd.steps``) and RELEASE (``parse_release``): random JSON-shaped
documents and mutations of valid ones go in; a parsed value or the protocol's
own error comes out. Round trips of valid messages hold, and what a node builds
stays within the bounds it parses with. (FORWARD and TOKEN are binary: fuzzed in
tests/test_steps.py.)
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.cluster.election import Announce, Pin, Term
from ringd.cluster.messages import MAX_DRAINED, MAX_GOSSIPED_PEERS, MAX_INSTANCES, Heartbeat, MessageError, PoolModel, parse_control, parse_loaded
from ringd.ring.plan import MAX_INSTANCE_CHARS
from ringd.ring.steps import Failure, parse_release
from ringd.ring.plan import Plan, PlacementError, make_plan
from ringd.cluster.reconcile import LOADED, Report
from wire.frames import Frame, FrameError, MsgType

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,12}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)

heartbeats = st.builds(
    Heartbeat,
    st.builds(Announce, st.builds(Term, st.integers(1, 2**53 - 1), names), st.none() | names, st.builds(Pin, st.integers(0, 9), st.none() | names)),
    st.just(Report(Term(3, "a"), LOADED)) | st.just(Report()),
    st.dictionaries(names, st.builds(lambda a, p: f"10.0.{a}.1:{p}", st.integers(0, 255), st.integers(1, 65535)), max_size=MAX_GOSSIPED_PEERS),
    st.none() | st.lists(names, max_size=MAX_DRAINED, unique=True).map(tuple),
    pool=st.none() | st.just(()) | st.just(tuple(  # the most a leader tells: MAX_INSTANCES instances of the longest names
        PoolModel("m" * MAX_INSTANCE_CHARS, 300.0, tuple(f"{i:04d}".ljust(MAX_INSTANCE_CHARS, "i") for i in range(k, k + 8)))
        for k in range(0, MAX_INSTANCES, 8)
    )),
)


def valid_messages():
    """kind -> (a valid document, what its parser makes of it)."""
    beat = Heartbeat(
        Announce(Term(4, "node1"), "node1", Pin()), Report(Term(4, "node1"), LOADED), {"node2": "10.0.0.2:50051"}, ("node3",), Term(4, "node1"), "",
        pool=(PoolModel("tiny-b", 300.0, ("tiny-b", "tiny-b#2")), PoolModel("", None, ("", "base#2"))),
    )  # fmt: skip
    plan = make_plan(7, "node1", "fp", 6, [("node1", "10.0.0.1:50051"), ("node2", "10.0.0.2:50051")])
    failure = Failure(3, 7, "node2", "no stage loaded here", 503)  # 3: the frame's id, as PARSERS sends it
    return {
        "heartbeat": (beat.to_wire(), beat),
        "control": ({"election": beat.election.to_wire()}, beat.election),
        "loaded": (beat.report.to_wire(), beat.report),
        "plan": (plan.to_wire(), plan),
        "error": (failure.frame().descriptor, failure),
        "release": ({"term": 7, "keep": True}, (7, "keep")),
    }


def valid_docs():
    return {kind: doc for kind, (doc, _) in valid_messages().items()}


PARSERS = {
    "heartbeat": (Heartbeat.from_wire, MessageError),
    "control": (parse_control, MessageError),
    "loaded": (parse_loaded, MessageError),
    "plan": (Plan.from_wire, PlacementError),
    "error": (lambda d: Failure.parse(Frame(MsgType.ERROR, 3, d)), FrameError),
    "release": (parse_release, FrameError),
}


def mutate(doc, data):
    """One random change somewhere inside a JSON document: replace, drop or add a value."""
    if isinstance(doc, dict) and doc and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(doc)))
        choice = data.draw(st.integers(0, 2))
        if choice == 0:
            return {k: v for k, v in doc.items() if k != key}
        if choice == 1:
            return {**doc, key: data.draw(json_values)}
        return {**doc, key: mutate(doc[key], data)}
    if isinstance(doc, list) and doc and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(doc) - 1))
        return doc[:i] + [mutate(doc[i], data)] + doc[i + 1 :]
    return data.draw(json_values)


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_valid_messages_parse(kind):
    parse, _ = PARSERS[kind]
    doc, value = valid_messages()[kind]
    assert parse(json.loads(json.dumps(doc))) == value  # as it arrives: through JSON


@pytest.mark.parametrize("kind", sorted(PARSERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_mutated_and_random_messages_raise_only_their_protocol_error(kind, data):
    parse, error = PARSERS[kind]
    how = data.draw(st.sampled_from(["random", "mutated", "mutated twice"]))
    if how == "random":
        doc = data.draw(json_values)
    else:
        doc = mutate(valid_docs()[kind], data)
        if how == "mutated twice":
            doc = mutate(doc, data)
    doc = json.loads(json.dumps(doc))  # only what JSON can carry arrives
    try:
        parse(doc)
    except error:
        pass


@given(heartbeats)
def test_heartbeats_round_trip_and_always_fit_a_frame(beat):
    wire = beat.to_wire()
    assert Heartbeat.from_wire(json.loads(json.dumps(wire))) == beat
    from wire.frames import MAX_DESCRIPTOR_BYTES

    assert len(json.dumps(wire)) < MAX_DESCRIPTOR_BYTES


def test_heartbeats_refuse_what_a_node_would_never_build():
    good = valid_docs()["heartbeat"]
    too_many = [{"model": f"m{i}", "keep_alive": None, "instances": [f"m{i}", f"m{i}#2"]} for i in range(MAX_INSTANCES // 2 + 1)]
    for pool, why in [
        (too_many, "at most 32 instances"), ([{"model": "m", "keep_alive": -1, "instances": ["m"]}], "keep_alive"),
        ([{"model": "m", "keep_alive": None, "instances": []}], "1 to 16 instances"), ({"m": 1}, "list"),
        ([{"model": "m\n", "keep_alive": None, "instances": ["m"]}], "printable"),
    ]:  # fmt: skip
        with pytest.raises(MessageError, match=why):
            Heartbeat.from_wire({**good, "pool": pool})
    with pytest.raises(MessageError, match="at most 64 node"):
        Heartbeat.from_wire({**good, "knows": {f"n{i}": "10.0.0.1:1" for i in range(MAX_GOSSIPED_PEERS + 1)}})
    with pytest.raises(MessageError, match="drained node"):
        Heartbeat.from_wire({**good, "drained": ["x" * 70_000]})
    with pytest.raises(MessageError, match="must be an IP address"):
        Heartbeat.from_wire({**good, "knows": {"node2": "mac.local:50051"}})
    with pytest.raises(MessageError, match="keys"):
        Heartbeat.from_wire({k: v for k, v in good.items() if k != "reason"})
    with pytest.raises(MessageError):
        Heartbeat(Announce(Term(1, "a"), None, Pin()), Report(), {}, tuple(f"n{i}" for i in range(MAX_DRAINED + 1)))
