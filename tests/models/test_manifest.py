"""ringd.models.peers.manifest: what a holder lists, what a fetcher believes of it, and what a stage needs.

The wire form is fuzzed (a fetcher parses what a peer sends: only ManifestError may
come out, and no file name may reach outside the model's directory); the chunk and
range arithmetic holds under Hypothesis; and the rule of what a stage fetches is the
rule it loads by (``Shard``), for every architecture.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.models.peers import manifest as m
from ringd.models.source import model_info
from ringd.models.tinyarchs import ARCHS
from ringd.stage.shard import Shard

PIECE = 4096

hashes = st.text("0123456789abcdef", min_size=64, max_size=64)


@st.composite
def manifests(draw):
    files = []
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_.-]{0,10}(/[a-z][a-z0-9_.-]{0,10})?", fullmatch=True).filter(lambda n: ".." not in n.split("/")), min_size=1, max_size=5, unique=True))
    for name in names:
        size = draw(st.integers(0, 5 * PIECE))
        weights = draw(st.booleans())
        head = draw(st.integers(0, size)) if weights else size
        bounds = m.cut(size, draw(st.lists(st.integers(0, size), max_size=6)), PIECE)
        files.append(m.FileEntry(name, size, head, bounds, tuple(draw(st.lists(hashes, min_size=len(bounds) - 1, max_size=len(bounds) - 1))), weights))
    return m.Manifest("fp0123", "tiny", False, tuple(files), digest="local:0123")


@given(manifests())
def test_manifests_round_trip_through_json(man):
    assert m.Manifest.from_wire(json.loads(json.dumps(man.to_wire()))) == man


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


def _mutate(doc, data):
    if isinstance(doc, dict) and doc and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(doc)))
        return {**doc, key: _mutate(doc[key], data) if data.draw(st.booleans()) else data.draw(json_values)}
    if isinstance(doc, list) and doc and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(doc) - 1))
        return doc[:i] + [_mutate(doc[i], data)] + doc[i + 1 :]
    return data.draw(json_values)


@settings(max_examples=300, deadline=None)
@given(manifests(), st.data())
def test_any_other_document_is_a_manifest_error_and_no_name_leaves_the_directory(man, data):
    doc = json.loads(json.dumps(_mutate(man.to_wire(), data)))
    try:
        parsed = m.Manifest.from_wire(doc)
    except m.ManifestError:
        return
    for f in parsed.files:
        assert not f.name.startswith("/") and ".." not in f.name.split("/") and "\\" not in f.name


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "/etc/passwd", "a/../../b", "a\\b", "", ".", "a//b", "x" * 300, "a/./b"],
)
def test_names_outside_the_model_are_refused(name):
    doc = m.Manifest("fp", "t", False, (m.FileEntry("config.json", 1, 1, (0, 1), ("0" * 64,), False),), digest="local:0").to_wire()
    doc["files"][0]["name"] = name
    with pytest.raises(m.ManifestError):
        m.Manifest.from_wire(doc)


@given(st.integers(1, 10 * PIECE), st.lists(st.integers(0, 10 * PIECE), max_size=8), st.data())
def test_pieces_cut_at_tensors_hold_exactly_the_bytes_asked_for(size, starts, data):
    bounds = m.cut(size, starts, PIECE)
    assert bounds[0] == 0 and bounds[-1] == size and all(0 < b - a <= PIECE for a, b in zip(bounds, bounds[1:]))
    assert {s for s in starts if 0 < s < size} <= set(bounds)  # a piece never spans two tensors
    f = m.FileEntry("w", size, 0, bounds, ("0" * 64,) * (len(bounds) - 1), True)
    a = data.draw(st.integers(0, size - 1))
    b = data.draw(st.integers(a + 1, size))
    spans = [f.span(i) for i in f.pieces(a, b)]
    assert spans[0][0] <= a < spans[0][1] and spans[-1][0] < b <= spans[-1][1]  # all of it, and no piece more
    assert all(s[1] == t[0] for s, t in zip(spans, spans[1:]))


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), max_size=12))
def test_merged_ranges_cover_the_same_bytes(ranges):
    merged = m.merge_ranges(ranges)
    covered = {x for a, b in ranges for x in range(a, b)}
    assert {x for a, b in merged for x in range(a, b)} == covered
    assert all(b < c for (_, b), (c, _) in zip(merged, merged[1:]))  # disjoint, apart, sorted


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_stage_fetches_what_it_loads_for_every_architecture(tiny_model, arch):
    """The tensors a stage fetches by its checkpoint's keys are the parameters it loads: no
    fewer (a hole would read as zeros), no more (it fetches only its share)."""
    path = tiny_model(arch=arch, layers=4, dtype="float32")
    info = model_info(str(path))
    tables = {}
    for f in sorted(path.glob("model*.safetensors")):
        raw = f.read_bytes()
        head = 8 + int.from_bytes(raw[:8], "little")
        tables[f.name] = m.safetensors_ranges(raw[:head], head)
    key_of = {span: (file, key) for file, table in tables.items() for key, span in table.items()}
    for start, end in [(0, 1), (1, 3), (3, 4), (0, 4), (2, 4)]:
        stage = Shard.load(str(path), start, end)
        loads = {name for name, _ in stage._named_parameters()}  # what it read at load, by the model's names
        fetched = m.safetensors_stage_ranges(tables, start, end, info.num_layers)
        keys = {key_of[span][1] for table in tables.values() for span in table.values() if any(a <= span[0] and span[1] <= b for a, b in fetched.get(key_of[span][0], []))}
        assert loads <= keys, f"[{start}, {end}) loads {sorted(loads - keys)[:5]} it would not fetch"
        assert keys <= set().union(*tables.values()) and not keys - loads, f"[{start}, {end}) would fetch {sorted(keys - loads)[:5]} it does not load"


def test_a_manifest_is_kept_while_the_files_are_unchanged(tiny_model, tmp_path):
    import shutil

    path = tmp_path / "model"  # a copy: the tiny models are kept between runs, and this one is touched
    shutil.copytree(tiny_model(arch="llama", layers=2, dtype="float32"), path)
    info = model_info(str(path))
    first = m.cached(path, info.fingerprint, "tiny", tmp_path)
    assert {f.name for f in first.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    weights = first.file("model.safetensors")
    assert weights.weights and 8 < weights.head < weights.size and not first.file("config.json").weights
    assert len(weights.hashes) > 10 and weights.head in weights.bounds  # cut at the header and each tensor
    store = tmp_path / "manifests" / f"{info.fingerprint}.json"
    saved = json.loads(store.read_text())
    saved["manifest"]["label"] = "kept"  # a rebuild would not say this
    store.write_text(json.dumps(saved))
    assert m.cached(path, info.fingerprint, "tiny", tmp_path).label == "kept"
    st = (path / "config.json").stat()
    os.utime(path / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a file that changed: built again
    assert m.cached(path, info.fingerprint, "tiny", tmp_path).label == "tiny"


def test_a_holder_whose_files_changed_since_it_loaded_them_builds_no_manifest(tiny_model, tmp_path):
    """Its peers would fetch bytes the ring does not compute with: it says to restart instead."""
    import shutil

    from ringd.models.fingerprint import digest_samples
    from ringd.models.source import model_info

    path = tmp_path / "model"
    shutil.copytree(tiny_model(arch="llama"), path)
    fingerprint = model_info(str(path)).fingerprint
    assert m.build(path, fingerprint, "t").digest.startswith("local:")
    [(name, spans)] = digest_samples(path).items()
    with open(path / name, "r+b") as f:  # a byte where the fingerprint reads
        f.seek(spans[1][0])
        byte = f.read(1)
        f.seek(spans[1][0])
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(m.ManifestError, match="restart the node"):
        m.build(path, fingerprint, "t")

