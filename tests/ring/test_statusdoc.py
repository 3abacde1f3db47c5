"""ringd.ring.statusdoc: the status document, written once and read forgivingly."""

import dataclasses
import json

from hypothesis import given
from hypothesis import strategies as st

from ringd.ring.statusdoc import ClusterStatus, NodeStatus

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [f.name for f in dataclasses.fields(NodeStatus)]


@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=12) | json_values)
def test_any_json_reads_as_a_status_with_less_said(doc):
    """A node of another version, or a peer that lies: whatever it sent, a status comes back
    whose fields each hold what its type says (or its default), and it writes back as JSON."""
    n = NodeStatus.parse(doc)
    assert isinstance(n.node, str) and isinstance(n.ready, bool)
    for name in ("sessions", "kv_bytes", "budget", "kv_capacity"):
        v = getattr(n, name)
        assert v is None or (isinstance(v, int) and not isinstance(v, bool)), (name, v)
    assert isinstance(n.drained, list) and isinstance(n.links, dict)
    json.dumps(n.to_wire())
    c = ClusterStatus.parse({"node": "a", "nodes": [doc, doc] if isinstance(doc, dict) else doc})
    assert all(isinstance(x, NodeStatus) for x in c.nodes)


def test_a_status_reads_back_as_written():
    n = NodeStatus("node1", ready=True, role="leader", leader="node1", layers=[0, 4], sessions=2, kv_bytes=4096, speed=12.5, drained=["node3"])
    assert NodeStatus.parse(json.loads(json.dumps(n.to_wire()))) == n
    c = ClusterStatus("node1", "node1", True, "", {"term": 3}, [n, NodeStatus("node2", error="no answer: timed out")])
    assert ClusterStatus.parse(json.loads(json.dumps(c.to_wire()))) == c
    assert c.status_of("node1").leading and c.status_of("node9") is None


def test_a_node_that_did_not_answer_says_only_why():
    assert NodeStatus("node2", error="no answer: refused").to_wire() == {"node": "node2", "ready": False, "error": "no answer: refused"}
    unknown = NodeStatus.parse({"node": "node2", "ready": False, "error": "no answer: refused"})
    assert (unknown.sessions, unknown.budget, unknown.role) == (None, None, "")


def test_a_field_of_the_wrong_type_is_unknown():
    n = NodeStatus.parse({"node": "n", "sessions": "3", "budget": True, "speed": 2, "layers": "0-4", "ready": 1})
    assert (n.sessions, n.budget, n.speed, n.layers, n.ready) == (None, None, 2, None, False)
