"""tools/layers: the house's imports point down only, counting every import."""

from __future__ import annotations

from devkit.toolscript import load


def test_no_cycle_and_no_arrow_up():
    graph, problems = load("layers").check()
    assert len(graph) > 80, "the tool found the modules"
    assert problems == [], "\n".join(problems)


def test_an_import_inside_a_function_or_under_type_checking_counts(tmp_path):
    """A cycle hidden by an import in a function, and an arrow up under TYPE_CHECKING, are found."""
    layers = load("layers")
    pkg = tmp_path / "ringd"
    (pkg / "ring").mkdir(parents=True)
    (tmp_path / "wire").mkdir()
    (tmp_path / "wire" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ring" / "__init__.py").write_text("")
    (pkg / "ring" / "a.py").write_text("def f():\n    from ringd.ring import b\n")
    (pkg / "ring" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ringd.leader import engine\nfrom ringd.ring import a\n")
    (pkg / "leader").mkdir()
    (pkg / "leader" / "__init__.py").write_text("")
    (pkg / "leader" / "engine.py").write_text("")
    _, problems = layers.check(tmp_path)
    assert "cycle: ringd.ring.a <-> ringd.ring.b" in problems
    assert "upward: ringd.ring.b -> ringd.leader.engine (ringd.ring is below ringd.leader)" in problems
